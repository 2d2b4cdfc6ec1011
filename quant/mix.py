"""Which GGML type each tensor gets when a GGUF file is quantized: llama-quantize's choice.

Mirrors llama.cpp 0c1e57098 (the build of llama-cpp-python 0.3.36 that made the goldens),
``src/llama-quant.cpp``: ``tensor_allows_quantization``, ``llama_tensor_get_type`` and
``llama_tensor_get_type_impl`` (the "mixture" rules of the K-quant, IQ, TQ and MXFP4 ftypes,
with and without an imatrix), ``tensor_type_fallback`` (row lengths that a type's block does not
divide, e.g. IQ4_XS -> IQ4_NL), ``tensor_requires_imatrix`` (:func:`check_writable`) and the
tensor order of ``llama_model_loader::weights_map``. The ftypes are those of :data:`FILE_TYPES`
(no ``--tensor-type`` overrides); every one is planned (``--dry-run``), and written when
quant.quantize has a quantizer for each of its tensor types (:func:`check_writable` names the
missing ones: the IQ1/IQ2/IQ3, TQ and MXFP4 types today).

One deliberate difference: where llama.cpp would write a tensor whose row length its type's
block does not divide (``--token-embedding-type`` / ``--output-tensor-type`` are applied without
fallback) and then abort with a half-written file, :func:`choose_types` raises QuantizeError
before anything is written.
"""
from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import Enum

from gguf import GGMLQuantizationType, GGUFValueType, Keys, LlamaFileType

from kernels_cpu.ggml_types import TYPES, sizes
from quant.errors import QuantizeError

T = GGMLQuantizationType

# ggml_is_quantized is false for these
_FLOAT_TYPES = frozenset((T.F32, T.F16, T.BF16, T.F64, T.I8, T.I16, T.I32, T.I64))
_INT_VALUE_TYPES = (GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
                    GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64)
# tensor_type_fallback for the types edge writes: K-quants on rows that 256 does not divide
_FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0,
             T.TQ1_0: T.Q4_0, T.TQ2_0: T.Q4_0,
             **{t: T.IQ4_NL for t in (T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_XS)}}


@dataclass(frozen=True)
class FileType:
    """A llama-quantize TYPE: its name (``Q4_K_M``), the ``general.file_type`` value written
    (llama_ftype, e.g. 15) and the base GGML type of its tensors (llama_ftype_get_default_type)."""

    name: str
    file_type: int
    default_type: GGMLQuantizationType


FILE_TYPES: dict[str, FileType] = {
    name: FileType(name, int(LlamaFileType[f"MOSTLY_{name}"]), base)
    for name, base in (
        ("F16", T.F16), ("BF16", T.BF16), ("Q8_0", T.Q8_0), ("Q4_0", T.Q4_0), ("Q4_1", T.Q4_1),
        ("Q5_0", T.Q5_0), ("Q5_1", T.Q5_1), ("Q2_K", T.Q2_K), ("Q3_K_S", T.Q3_K), ("Q3_K_M", T.Q3_K),
        ("Q3_K_L", T.Q3_K), ("Q4_K_S", T.Q4_K), ("Q4_K_M", T.Q4_K), ("Q5_K_S", T.Q5_K),
        ("Q5_K_M", T.Q5_K), ("Q6_K", T.Q6_K),
        # llama-quantize's IQ, TQ and MXFP4 mixes and Q2_K_S: planned; written when edge has the
        # quantizers of all their types (see check_writable)
        ("Q2_K_S", T.Q2_K), ("IQ2_XXS", T.IQ2_XXS), ("IQ2_XS", T.IQ2_XS), ("IQ2_S", T.IQ2_XS), ("IQ2_M", T.IQ2_S),
        ("IQ1_S", T.IQ1_S), ("IQ1_M", T.IQ1_M), ("TQ1_0", T.TQ1_0), ("TQ2_0", T.TQ2_0), ("IQ3_XXS", T.IQ3_XXS),
        ("IQ3_XS", T.IQ3_S), ("IQ3_S", T.IQ3_S), ("IQ3_M", T.IQ3_S), ("IQ4_NL", T.IQ4_NL), ("IQ4_XS", T.IQ4_XS),
        ("MXFP4_MOE", T.MXFP4))
}


# llama-quantize's QUANT_OPTIONS aliases (tools/quantize/quantize.cpp)
FILE_TYPE_ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}
# llama-quantize's other types, which edge does not write (named in the error)
NOT_SUPPORTED = ("Q1_0", "Q2_0", "F32", "COPY")


def parse_file_type(text: str) -> FileType:
    """A TYPE argument as llama-quantize's ``try_parse_ftype`` reads it: a name, any case
    (``q4_k_m``), llama-quantize's aliases (Q3_K, Q4_K, Q5_K: the _M mixes), or the llama_ftype
    number (``15``). Raises QuantizeError listing the choices, and saying so for llama-quantize's
    types edge does not write (IQ*, TQ*, Q2_K_S, F32, COPY, ...)."""
    name = text.strip().upper()
    ft = FILE_TYPES.get(FILE_TYPE_ALIASES.get(name, name))
    if ft is None and text.strip().isdigit():
        ft = next((f for f in FILE_TYPES.values() if f.file_type == int(text)), None)
    if ft is None:
        what = (f"{name} is a llama-quantize type that edge does not write" if name in NOT_SUPPORTED
                else f"unknown quantization type {text!r}")
        raise QuantizeError(f"{what}; choose one of: {', '.join(FILE_TYPES)}")
    return ft


def parse_tensor_type(text: str, flag: str) -> GGMLQuantizationType:
    """A GGML type name given to ``flag`` (any case, as llama-quantize's ``parse_ggml_type``).
    Raises QuantizeError naming the flag and the types edge can write."""
    from quant.quantize import SUPPORTED_TYPES  # the quantizers (numba), loaded only when a type is named

    # the types edge writes, in the table's order, then those the table lacks
    tensor_types = [t for t in TYPES if t in SUPPORTED_TYPES] + [t for t in SUPPORTED_TYPES if t not in TYPES]
    t = next((t for t in tensor_types if t.name == text.strip().upper()), None)
    if t is None:
        raise QuantizeError(f"{flag}: unknown or unsupported GGML type {text!r}; choose one of: "
                            f"{', '.join(t.name for t in tensor_types)}")
    return t


@dataclass(frozen=True)
class QuantizeOptions:
    """llama-quantize's options (llama_model_quantize_params) that edge supports.

    pure: no mixture rules: every candidate tensor gets the ftype's base type (then fallback).
    output_tensor_type / token_embedding_type: type of ``output.weight`` / the token embeddings.
    leave_output_tensor: copy ``output.weight`` unchanged.
    allow_requantize: allow tensors that are already quantized to be converted (dequantized,
        then quantized again); without it such a tensor is an error.
    has_imatrix: an importance matrix is given (llama.cpp's qs.has_imatrix): Q4_0 / Q5_0 mixes
        then put the ffn_down of the first n_layer/8 layers in Q4_1 / Q5_1.
    """

    pure: bool = False
    output_tensor_type: GGMLQuantizationType | None = None
    token_embedding_type: GGMLQuantizationType | None = None
    leave_output_tensor: bool = False
    allow_requantize: bool = False
    has_imatrix: bool = False


@dataclass(frozen=True)
class ModelParams:
    """The hyperparameters the type choice reads (llama_hparams / llm_type).

    n_layer: ``{arch}.block_count``; n_head, n_head_kv: of layer 0 (the keys may be per-layer
    arrays; n_head_kv defaults to n_head); n_expert: ``{arch}.expert_count`` (0 if absent).
    """

    arch: str
    n_layer: int
    n_head: int = 0
    n_head_kv: int = 0
    n_expert: int = 0

    @classmethod
    def from_gguf(cls, gf) -> ModelParams:
        """Read from an :class:`edge.gguf_file.GGUFFile`. Raises GGUFError if
        ``general.architecture`` or ``{arch}.block_count`` is missing or mistyped."""
        arch = gf.get_str(Keys.General.ARCHITECTURE)

        def first(key: str, default: int) -> int:       # an integer, or a per-layer array's first
            key = key.format(arch=arch)
            field = gf.fields.get(key)
            if field is None:
                return default
            if field.value_type == GGUFValueType.ARRAY:
                values = gf.get_array(key, _INT_VALUE_TYPES)
                return int(values[0]) if len(values) else default
            return gf.get_int(key)

        n_head = first(Keys.Attention.HEAD_COUNT, 0)
        return cls(arch=arch, n_layer=gf.get_int(Keys.LLM.BLOCK_COUNT.format(arch=arch)), n_head=n_head,
                   n_head_kv=first(Keys.Attention.HEAD_COUNT_KV, n_head),
                   n_expert=first(Keys.LLM.EXPERT_COUNT, 0))

    @property
    def n_gqa(self) -> int:
        """Query heads per KV head (llama_hparams::n_gqa; 0 when n_head_kv is 0)."""
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        """llm_type is LLM_TYPE_70B (the load_arch_hparams of llama, qwen2, deci, olmo, jais2)."""
        if self.arch == "llama":
            return self.n_expert != 8 and self.n_layer == 80 and self.n_head != self.n_head_kv
        return (self.arch, self.n_layer) in (("qwen2", 80), ("deci", 80), ("olmo", 80), ("jais2", 68))


class Category(Enum):
    """tensor_category of llama-quant.cpp, from the tensor name (tensor_get_category)."""

    OUTPUT = "output"
    TOKEN_EMBD = "token_embd"
    ATTN_QKV = "attn_qkv"
    ATTN_KV_B = "attn_kv_b"
    ATTN_V = "attn_v"
    ATTN_K = "attn_k"
    ATTN_Q = "attn_q"
    ATTN_OUTPUT = "attn_output"
    FFN_UP = "ffn_up"
    FFN_GATE = "ffn_gate"
    FFN_DOWN = "ffn_down"
    OTHER = "other"


# substring -> category, tested in this order after the exact names (first match wins)
_CATEGORY_SUBSTRINGS = (("attn_qkv.weight", Category.ATTN_QKV), ("attn_kv_b.weight", Category.ATTN_KV_B),
                        ("attn_v.weight", Category.ATTN_V), ("attn_k.weight", Category.ATTN_K),
                        ("attn_q.weight", Category.ATTN_Q), ("attn_output.weight", Category.ATTN_OUTPUT),
                        ("ffn_up", Category.FFN_UP), ("ffn_gate", Category.FFN_GATE),
                        ("ffn_down", Category.FFN_DOWN))
_ATTN_V_LIKE = (Category.ATTN_V, Category.ATTN_QKV, Category.ATTN_KV_B)   # category_is_attn_v


def category(name: str) -> Category:
    """The tensor_category of a tensor name."""
    if name == "output.weight":
        return Category.OUTPUT
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return Category.TOKEN_EMBD
    return next((c for key, c in _CATEGORY_SUBSTRINGS if key in name), Category.OTHER)


# names containing one of these are never quantized (tensor_allows_quantization; the GLM5_NEXT
# extras are not listed: edge has no such model)
_NOT_QUANTIZED_SUBSTRINGS = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight",
    *(f"time_mix_{w}.weight" for w in ("first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2", "g1", "g2",
                                       "decay_w1", "decay_w2", "lerp_fused")),
    "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd",
    ".patch_merger", "a.rvq.codebook", "mm.a.code_embd")


def n_dims(shape: Sequence[int]) -> int:
    """ggml_n_dims: the number of dimensions without trailing dimensions of 1 (at least 1).
    ``shape`` is in ggml order (shape[0] = row length)."""
    n = len(shape)
    while n > 1 and shape[n - 1] == 1:
        n -= 1
    return n


def allows_quantization(name: str, shape: Sequence[int], options: QuantizeOptions) -> bool:
    """tensor_allows_quantization: may this tensor change type at all? (1-D tensors, norms,
    biases and the names llama.cpp keeps in full precision may not.)"""
    if n_dims(shape) < 2 or not name.endswith("weight"):
        return False
    if options.leave_output_tensor and name == "output.weight":
        return False
    if name in ("position_embd.weight", "token_types.weight"):
        return False
    return not any(s in name for s in _NOT_QUANTIZED_SUBSTRINGS)


_LAYER = re.compile(r"blk\.[ \t\n\v\f\r]*([+-]?[0-9]+)")


def layer_index(name: str) -> int:
    """N of a ``blk.N.`` name, -1 otherwise (the ``sscanf(name, "blk.%d.")`` of llama.cpp)."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


def llama_order(names: Sequence[str]) -> list[str]:
    """Tensor names in llama_model_loader::weights_map order: by layer (-1 for non-block
    tensors), then by name bytewise. llama-quantize writes its tensors in this order."""
    return sorted(names, key=lambda n: (layer_index(n), n.encode("utf-8", "surrogateescape")))


def block_size(t: GGMLQuantizationType) -> int:
    """Values per block of a GGML type (ggml_blck_size)."""
    return sizes(t)[0]


def row_bytes(t: GGMLQuantizationType, row_length: int) -> int:
    """Bytes of one row of ``row_length`` values (ggml_row_size); row_length a multiple of the block."""
    block, size = sizes(t)
    return row_length // block * size


def is_quantized(t: GGMLQuantizationType) -> bool:
    """ggml_is_quantized: a block format (not F32, F16, BF16, F64 or an integer type)."""
    return t not in _FLOAT_TYPES


@dataclass(frozen=True)
class TensorChoice:
    """One tensor of the output file.

    shape is in ggml order (shape[0] = row length, trailing dimensions of 1 included as in the
    source); src_type -> new_type; fallback_from is the type the rules chose when it had to be
    replaced because its block does not divide the row length (tensor_type_fallback), else None.
    """

    name: str
    shape: tuple[int, ...]
    src_type: GGMLQuantizationType
    new_type: GGMLQuantizationType
    fallback_from: GGMLQuantizationType | None = None

    @property
    def converts(self) -> bool:
        """True when the data changes (new type differs); False: bytes copied unchanged."""
        return self.src_type != self.new_type

    @property
    def n_rows(self) -> int:
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n

    @property
    def n_values(self) -> int:
        return self.n_rows * self.shape[0]

    @property
    def src_bytes(self) -> int:
        return self.n_rows * row_bytes(self.src_type, self.shape[0])

    @property
    def new_bytes(self) -> int:
        return self.n_rows * row_bytes(self.new_type, self.shape[0])


class _State:
    """The counters of quantize_state_impl the rules read (init_quantize_state_counters)."""

    def __init__(self, names: Sequence[str]):
        cats = [category(n) for n in names]
        self.tied = Category.OUTPUT not in cats            # no output.weight: it is token_embd
        self.n_attention_wv = sum(c in _ATTN_V_LIKE for c in cats)
        self.i_attention_wv = 0
        self.i_ffn_down = self.i_ffn_gate = self.i_ffn_up = 0


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# ftype groups of llama_tensor_get_type_impl
_IQ_LOW = ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M")     # the 1-2 bit IQ mixes' own branch
_IQ_OUTPUT_Q5_K = ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M")
_MOE8_ATTN_OUTPUT_Q5_K = ("Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S",
                          "IQ3_M", "IQ4_XS")


def _layer_of(name: str, i: int, model: ModelParams) -> int:
    """llama.cpp's layer_info: the running count ``i``, or with experts the name's layer."""
    if model.n_expert <= 1:
        return i
    i = layer_index(name)
    if i < 0 or i >= model.n_layer:
        raise QuantizeError(f"tensor {name!r}: cannot determine its layer (blk.N. with 0 <= N < {model.n_layer})")
    return i


def _mixture_type(t: GGMLQuantizationType, name: str, cat: Category, shape: Sequence[int], ftype: str,
                  model: ModelParams, options: QuantizeOptions, st: _State) -> GGMLQuantizationType:
    """llama_tensor_get_type_impl, branch by branch in llama.cpp's order. ``t`` is the ftype's
    base type. Advances the attn_v / ffn_down / ffn_gate / ffn_up counters as llama.cpp does."""
    falcon, ne0, n = model.arch == "falcon", shape[0], model.n_layer
    if cat is Category.OUTPUT or (st.tied and cat is Category.TOKEN_EMBD):
        if options.output_tensor_type is not None:
            return options.output_tensor_type
        if ftype == "MXFP4_MOE" or falcon or ne0 % block_size(t):
            return T.Q8_0
        if ftype in _IQ_OUTPUT_Q5_K:
            return T.Q5_K
        return t if t == T.Q8_0 else T.Q6_K
    if ftype == "MXFP4_MOE":        # expert tensors (3-D) -> MXFP4, the others Q8_0
        experts = len(shape) > 2 and shape[2] > 1
        ffn = cat in (Category.FFN_UP, Category.FFN_GATE, Category.FFN_DOWN)
        return T.MXFP4 if experts and (model.arch != "bailingmoe3" or ffn) else T.Q8_0
    if cat is Category.TOKEN_EMBD:
        if ftype in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
            return T.Q2_K
        if ftype in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
            return T.IQ3_S
        return T.Q4_K if ftype in ("TQ1_0", "TQ2_0", "Q2_0") else t
    iq2s = ftype in ("IQ2_S", "IQ2_M")
    if ftype in _IQ_LOW:
        if cat in _ATTN_V_LIKE:
            t = T.Q4_K if model.n_gqa >= 4 or model.n_expert >= 4 else T.IQ3_S if iq2s else T.Q2_K
            st.i_attention_wv += 1
        elif model.n_expert == 8 and cat is Category.ATTN_K:
            t = T.Q4_K
        elif cat is Category.FFN_DOWN:
            if st.i_ffn_down < n // 8:
                t = T.IQ3_S if iq2s else T.Q2_K
            st.i_ffn_down += 1
        elif cat is Category.ATTN_OUTPUT:
            if model.n_expert == 8:
                t = T.Q5_K
            elif ftype in ("IQ1_S", "IQ1_M"):
                t = T.IQ2_XXS
            elif iq2s:
                t = T.IQ3_S
        return t
    gqa4 = model.n_gqa >= 4
    if cat in _ATTN_V_LIKE:
        i = st.i_attention_wv
        if ftype == "Q2_K":
            t = T.Q4_K if gqa4 else T.Q3_K
        elif ftype == "Q2_K_S" and gqa4:
            t = T.Q4_K
        elif ftype == "IQ3_XXS":
            t = T.Q4_K if gqa4 else T.IQ3_XXS if options.has_imatrix else T.IQ3_S
        elif (ftype in ("IQ3_XS", "IQ3_S") and gqa4) or ftype == "IQ3_M":
            t = T.Q4_K
        elif ftype == "Q3_K_M":
            t = T.Q5_K if i < 2 else T.Q4_K
        elif ftype == "Q3_K_L" or (ftype in ("IQ4_NL", "IQ4_XS") and gqa4):
            t = T.Q5_K
        elif ftype in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i, st.n_attention_wv):
            t = T.Q6_K
        elif ftype == "Q4_K_S" and i < 4:
            t = T.Q5_K
        if model.is_70b and t in (T.Q3_K, T.Q4_K):
            t = T.Q5_K
        if model.n_expert == 8:
            t = T.Q8_0
        st.i_attention_wv += 1
    elif cat is Category.ATTN_K:
        if model.n_expert == 8:
            t = T.Q8_0
        else:
            t = {"IQ3_XS": T.IQ3_XXS, "IQ3_XXS": T.IQ2_S}.get(ftype, t)
    elif cat is Category.ATTN_Q:
        t = {"IQ3_XS": T.IQ3_XXS, "IQ3_XXS": T.IQ2_S}.get(ftype, t)
    elif cat is Category.FFN_DOWN:
        i = _layer_of(name, st.i_ffn_down, model)
        if ftype == "Q2_K":
            t = T.Q3_K
        elif ftype == "Q2_K_S":
            t = T.Q4_K if i < n // 8 else t
        elif ftype == "IQ3_XXS" and not options.has_imatrix:
            t = T.Q4_K if i < n // 8 else T.Q3_K
        elif ftype == "Q3_K_M":
            t = T.Q5_K if i < n // 16 else T.Q4_K if not falcon or _use_more_bits(i, n) else T.Q3_K
        elif ftype == "IQ3_M" and (i < n // 8 or (model.n_expert == 8 and _use_more_bits(i, n))):
            t = T.Q4_K
        elif ftype == "Q3_K_L":
            t = T.Q4_K if falcon else T.Q5_K
        elif ftype == "Q4_K_M":
            if falcon:
                t = T.Q6_K if i < n // 16 else T.Q5_K if _use_more_bits(i, n) else T.Q4_K
            elif _use_more_bits(i, n):
                t = T.Q6_K
        elif i < n // 8 and ftype in ("IQ4_NL", "IQ4_XS") and not options.has_imatrix:
            t = T.Q5_K
        elif ftype == "Q5_K_M" and _use_more_bits(i, n):
            t = T.Q6_K
        elif ftype == "Q4_K_S" and not falcon and i < n // 8:
            t = T.Q5_K
        elif ftype in ("Q4_0", "Q5_0") and options.has_imatrix and i < n // 8:
            t = T.Q4_1 if ftype == "Q4_0" else T.Q5_1
        st.i_ffn_down += 1
    elif cat is Category.ATTN_OUTPUT:
        if falcon:
            t = T.Q4_K if ftype == "Q3_K_L" else t
        elif model.n_expert == 8:
            t = T.Q5_K if ftype in _MOE8_ATTN_OUTPUT_Q5_K else t
        else:
            t = {"Q2_K": T.Q3_K, "IQ3_XXS": T.IQ3_S, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K, "IQ3_M": T.Q4_K}.get(ftype, t)
    elif cat in (Category.FFN_GATE, Category.FFN_UP):
        up = cat is Category.FFN_UP
        i = _layer_of(name, st.i_ffn_up if up else st.i_ffn_gate, model)
        if ftype == "IQ3_XS" and n // 8 <= i < 7 * n // 8:
            t = T.IQ3_XXS
        if up:
            st.i_ffn_up += 1
        else:
            st.i_ffn_gate += 1
    return t


def _target_type(name: str, cat: Category, shape: Sequence[int], ftype: FileType, model: ModelParams,
                 options: QuantizeOptions, st: _State) -> tuple[GGMLQuantizationType, GGMLQuantizationType | None]:
    """llama_tensor_get_type for a tensor that allows quantization: (new type, the type the
    rules chose if the fallback replaced it, else None)."""
    if options.token_embedding_type is not None and cat is Category.TOKEN_EMBD:
        return options.token_embedding_type, None     # no fallback in llama.cpp
    if options.output_tensor_type is not None and cat is Category.OUTPUT:
        return options.output_tensor_type, None       # no fallback in llama.cpp
    t = ftype.default_type
    if not is_quantized(t):
        return t, None
    if not options.pure:
        t = _mixture_type(t, name, cat, shape, ftype.name, model, options, st)
    ne0 = shape[0]
    if ne0 % block_size(t) == 0:
        return t, None
    fallback = _FALLBACK.get(t, t)
    return (fallback if ne0 % block_size(fallback) == 0 else T.F16), t


def choose_types(tensors: Sequence[tuple[str, Sequence[int], GGMLQuantizationType]], ftype: FileType,
                 options: QuantizeOptions, model: ModelParams) -> list[TensorChoice]:
    """The output tensors, in llama-quantize's order, each with its new type.

    ``tensors``: (name, shape in ggml order, source type) of every tensor of the source file.
    Returns one :class:`TensorChoice` per tensor, sorted by :func:`llama_order`.

    Raises QuantizeError, before anything is written, if a tensor would get a type whose block
    does not divide its row length (only possible through --token-embedding-type or
    --output-tensor-type, which llama.cpp applies without fallback), if a quantized source
    tensor would be converted without ``options.allow_requantize`` (llama.cpp: "requantizing
    from type X is disabled"), or if a ffn_down tensor of an MoE model has no layer number.
    """
    by_name = {name: (tuple(int(d) for d in shape), T(src)) for name, shape, src in tensors}
    order = llama_order(list(by_name))
    st = _State(order)
    out = []
    for name in order:
        shape, src = by_name[name]
        new, fallback_from = src, None
        if allows_quantization(name, shape, options):
            cat = category(name)
            new, fallback_from = _target_type(name, cat, shape, ftype, model, options, st)
            if shape[0] % block_size(new):
                flag = "--token-embedding-type" if cat is Category.TOKEN_EMBD else "--output-tensor-type"
                raise QuantizeError(
                    f"{flag} {new.name}: {name} has rows of {shape[0]} values, which {new.name}'s blocks of "
                    f"{block_size(new)} do not divide; choose a type whose block divides {shape[0]} "
                    "(Q8_0, Q5_1, Q5_0, Q4_1, Q4_0 have blocks of 32; F16, BF16, F32 of 1)")
        if new != src and is_quantized(src) and not options.allow_requantize:
            raise QuantizeError(f"tensor {name} is already quantized ({src.name}); requantizing it to {new.name} "
                                "loses quality: quantize from an F32/F16/BF16 file, or pass --allow-requantize")
        out.append(TensorChoice(name, shape, src, new, fallback_from))
    return out


# tensor_requires_imatrix: these target types need an importance matrix (Q2_K only in Q2_K_S)
_NEED_IMATRIX = frozenset((T.IQ3_XXS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_M, T.IQ1_S))


def check_writable(tensors: Sequence[TensorChoice], ftype: FileType, imatrix_names: Collection[str] | None,
                   writable: Collection[GGMLQuantizationType]) -> None:
    """What a real run (not a dry run) checks before writing anything: llama.cpp's
    tensor_requires_imatrix refusals (a tensor converted to IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS,
    IQ2_S, IQ3_XXS, or to Q2_K in a Q2_K_S file, other than token_embd / output, needs an
    imatrix: ``imatrix_names`` None, or without an entry of that tensor), then the types edge
    has no quantizer for (``writable``: quant.quantize.SUPPORTED_TYPES).
    Raises QuantizeError (one line) naming the tensor and type, or every type edge cannot write."""
    for t in tensors:
        if not t.converts or t.name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
            continue
        if t.new_type in _NEED_IMATRIX or (t.new_type == T.Q2_K and ftype.name == "Q2_K_S"):
            if imatrix_names is None:
                raise QuantizeError(f"{ftype.name} requires an importance matrix (--imatrix): tensor {t.name} "
                                    f"would be {t.new_type.name}, which llama.cpp does not quantize without one")
            if t.name not in imatrix_names:
                raise QuantizeError(f"the imatrix has no entry for tensor {t.name}, which {ftype.name} makes "
                                    f"{t.new_type.name} (a very low-bit type that needs one)")
    missing = sorted({t.new_type for t in tensors if t.converts and t.new_type not in writable}, key=lambda t: t.name)
    if missing:
        raise QuantizeError(f"the {ftype.name} mix needs GGML type{'s' if len(missing) > 1 else ''} "
                            f"{', '.join(t.name for t in missing)}, which edge cannot write yet "
                            "(--dry-run shows the plan)")
