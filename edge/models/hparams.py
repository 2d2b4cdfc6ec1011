"""Model hyperparameters from GGUF metadata, each checked before anything is sized by it.

A model file is untrusted input, and its hyperparameters size arrays and index memory in
numba kernels that do not check bounds: a RoPE dimension count above the head size makes the
RoPE kernel write past the q/k rows, a block count of 2^40 would size per-layer structures
before any tensor is looked at, a head count of 0 divides by zero. So an architecture reads
its values through this module, and they are checked in two steps:

1. when read (:func:`read_int`, :func:`read_float`, :func:`read_block_count`,
   :func:`read_rope_freq_scale`, :func:`read_swa_layers`): each value's type and range on its
   own. Counts and sizes are integers in 1..2^32-1 (llama.cpp reads them as uint32);
   block_count is at most 512 (llama.cpp's LLAMA_MAX_LAYERS) and must match the blk.N
   tensors present; floats are finite.
2. before a Transformer is built (:meth:`ModelArgs.check`): the values against each other
   (head_count_kv divides head_count; rope.dimension_count even and within the head); then
   the tensor loader (edge.models.weights) holds every tensor the architecture declares to
   the shape the metadata gives (:meth:`ModelArgs.dim`), so no kernel sees a size the file's
   tensors do not back.

A fault is one GGUFError naming the key, its value and what it must agree with. Where llama.cpp
refuses a value edge refuses it too (block_count above 512; for llama and qwen2 a
rope.dimension_count other than the head size; an odd one or one above the head size); a value
llama.cpp gives a meaning is taken with that meaning (sliding_window_pattern 0: every layer
uses the window; a per-layer array of the pattern). Deliberate differences: rope.dimension_count
0 is refused (llama.cpp then rotates nothing); an integer key may have any integer type and a
float key any number type, range-checked (llama.cpp wants uint32 and float32 exactly); a
per-layer array for head counts or feed_forward_length is refused as a type error.
"""
from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass, fields
from typing import ClassVar

from gguf import GGUFValueType, Keys

from edge.gguf_file import GGUFError, GGUFFile

UINT32_MAX = 2**32 - 1
MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS
TOKENS_KEY = Keys.Tokenizer.LIST
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.")


def read_int(gf: GGUFFile, key: str, default: int | None = None, lo: int = 1, hi: int = UINT32_MAX) -> int:
    """Integer metadata ``key`` (``default`` when absent; required without one) in lo..hi.

    Raises GGUFError naming the key when it is missing, not an integer, or out of range (a
    default too, which the message says was the default).
    """
    v = gf.get_int(key, default=default)
    if not lo <= v <= hi:
        raise GGUFError(f"{gf.path}: {_shown(gf, key, v)} is out of range: it must be in {lo}..{hi}")
    return v


def _shown(gf: GGUFFile, key: str, value) -> str:
    """``key = value`` for a message, saying so when the value is a default (the key absent)."""
    return f"{key} = {value!r}" + ("" if key in gf.fields else " (absent; the default)")


def read_float(gf: GGUFFile, key: str, default: float | None = None, lo: float | None = None,
               strict: bool = False) -> float:
    """Float metadata ``key`` that must be finite and, with ``lo``, >= lo (> lo if ``strict``).

    Raises GGUFError naming the key when it is missing (without a default), not a number, not
    finite or below the bound.
    """
    v = gf.get_float(key, default=default)
    if not math.isfinite(v) or (lo is not None and (v <= lo if strict else v < lo)):
        bound = "" if lo is None else f" {'>' if strict else '>='} {lo:g}"
        raise GGUFError(f"{gf.path}: {_shown(gf, key, v)} is out of range: it must be a finite number{bound}")
    return v


def check_block_count(gf: GGUFFile, key: str, n_layer: int) -> None:
    """Hold block_count to the blk.N tensors present: blocks 0 .. n_layer-1, each with a tensor.

    Raises GGUFError naming the key, its value and the blocks the file has.
    """
    found = {int(m.group(1)) for m in map(_BLOCK_NAME.match, gf.tensors) if m}
    if found == set(range(n_layer)):
        return
    if not found:
        have = "no blk.N tensors"
    else:
        top = max(found)
        missing = sorted(set(range(top + 1)) - found)
        have = f"tensors of blocks blk.0 .. blk.{top}" + (
            f" without blk.{', blk.'.join(map(str, missing[:4]))}{' ...' if len(missing) > 4 else ''}"
            if missing else f" ({top + 1} blocks)")
    raise GGUFError(f"{gf.path}: {key} = {n_layer}, but the file has {have}")


def read_block_count(gf: GGUFFile, key: str) -> int:
    """block_count in 1..512 (llama.cpp's limit), held to the blk.N tensors present before
    anything per layer is built from it. Raises GGUFError naming the key."""
    n = read_int(gf, key, hi=MAX_LAYERS)
    check_block_count(gf, key, n)
    return n


def read_rope_freq_scale(gf: GGUFFile, arch: str) -> float:
    """RoPE frequency scale as llama.cpp sets it: 1 / rope.scaling.factor (factor 0 or absent:
    1) for linear scaling, the default type; 1 for type "none".

    Raises GGUFError for another scaling type (edge implements none and linear) or a factor
    that is negative or not finite.
    """
    type_key = Keys.Rope.SCALING_TYPE.format(arch=arch)
    kind = gf.get_str(type_key, default="linear")
    if kind not in ("none", "linear"):
        raise GGUFError(f"{gf.path}: {type_key} = {kind!r} is not supported (supported: none, linear)")
    factor = read_float(gf, Keys.Rope.SCALING_FACTOR.format(arch=arch), default=0.0, lo=0.0)
    return 1.0 / factor if kind == "linear" and factor > 0 else 1.0


def read_swa_layers(gf: GGUFFile, arch: str, n_layer: int, window: int, default_pattern: int) -> tuple[bool, ...]:
    """Which layers use the sliding window, as llama.cpp's load_swa_pattern: none without a
    window; else ``attention.sliding_window_pattern`` (``default_pattern`` when absent), either
    a period n (every n-th layer global, the others local; 0: every layer local) or an array
    of n_layer booleans or integers (nonzero: local).

    Raises GGUFError naming the key for a wrong type, a value above 2^32-1 or an array whose
    length is not block_count.
    """
    if window == 0:
        return (False,) * n_layer
    key = Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=arch)
    field = gf.fields.get(key)
    if field is not None and field.value_type == GGUFValueType.ARRAY:
        arr = gf.get_array(key, (GGUFValueType.BOOL, GGUFValueType.INT32, GGUFValueType.UINT32))
        if len(arr) != n_layer:
            raise GGUFError(f"{gf.path}: {key} has {len(arr)} entries, but "
                            f"{Keys.LLM.BLOCK_COUNT.format(arch=arch)} = {n_layer}")
        return tuple(bool(x) for x in arr)
    n = read_int(gf, key, default=default_pattern, lo=0)
    return tuple(n == 0 or il % n < n - 1 for il in range(n_layer))


@dataclass
class ModelArgs:
    """Hyperparameters read from ``{arch}.*`` metadata that every architecture has (llama.cpp's
    llama_hparams); an architecture with more subclasses it (edge.models.gemma3.Gemma3Args).

    head_dim is ``attention.key_length`` (n_embd / n_head when absent); ``rope_neox`` selects
    GPT-NeoX RoPE pairing; ``partial_rope`` allows ``rope.dimension_count`` below head_dim
    (otherwise it must equal head_dim, as llama.cpp requires for llama and qwen2);
    ``swa_layers[i]`` is True for sliding-window layers, which use ``sliding_window`` and their
    own RoPE base ``rope_freq_base_swa``; ``rope_attn_factor`` (rope.scaling.attn_factor, default
    1) multiplies RoPE's cos and sin (llama.cpp's attn_factor). Call :meth:`check` before sizing anything from them;
    :meth:`dim` evaluates the tensor shapes an architecture declares in these fields.
    """

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    rms_eps: float
    rope_freq_base: float
    rope_freq_scale: float
    n_rot: int
    rope_neox: bool
    partial_rope: bool = False
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()
    rope_freq_base_swa: float = 10000.0
    rope_freq_scale_swa: float = 1.0
    rope_attn_factor: float = 1.0

    # the metadata key (gguf.Keys template) of each field a tensor shape may name (n_vocab: the
    # token list); a subclass adds its own fields' keys
    KEYS: ClassVar[dict[str, str]] = {
        "n_embd": Keys.LLM.EMBEDDING_LENGTH, "n_ff": Keys.LLM.FEED_FORWARD_LENGTH,
        "n_layer": Keys.LLM.BLOCK_COUNT, "n_ctx_train": Keys.LLM.CONTEXT_LENGTH,
        "n_head": Keys.Attention.HEAD_COUNT, "n_head_kv": Keys.Attention.HEAD_COUNT_KV,
        "head_dim": Keys.Attention.KEY_LENGTH, "head_dim_v": Keys.Attention.VALUE_LENGTH,
        "n_rot": Keys.Rope.DIMENSION_COUNT,
    }

    @classmethod
    def common_from_gguf(cls, gf: GGUFFile, arch: str, **overrides) -> "ModelArgs":
        """Read the keys every architecture shares, each type- and range-checked (module
        docstring, step 1); ``overrides`` sets arch-specific fields.

        Raises GGUFError naming a missing, mistyped or out-of-range key, a block_count that the
        blk.N tensors do not match, or an unsupported RoPE scaling.
        """
        def key(template: str) -> str:
            return template.format(arch=arch)

        n_layer = read_block_count(gf, key(Keys.LLM.BLOCK_COUNT))
        n_embd = read_int(gf, key(Keys.LLM.EMBEDDING_LENGTH))
        n_head = read_int(gf, key(Keys.Attention.HEAD_COUNT))
        head_dim = read_int(gf, key(Keys.Attention.KEY_LENGTH), default=n_embd // n_head)
        args = dict(
            arch=arch,
            n_vocab=len(gf.get_array(TOKENS_KEY, (GGUFValueType.STRING,))),
            n_ctx_train=read_int(gf, key(Keys.LLM.CONTEXT_LENGTH)),
            n_embd=n_embd,
            n_layer=n_layer,
            n_ff=read_int(gf, key(Keys.LLM.FEED_FORWARD_LENGTH)),
            n_head=n_head,
            n_head_kv=read_int(gf, key(Keys.Attention.HEAD_COUNT_KV), default=n_head),
            head_dim=head_dim,
            head_dim_v=read_int(gf, key(Keys.Attention.VALUE_LENGTH), default=n_embd // n_head),
            rms_eps=read_float(gf, key(Keys.Attention.LAYERNORM_RMS_EPS), lo=0.0),   # ggml: eps >= 0
            rope_freq_base=read_float(gf, key(Keys.Rope.FREQ_BASE), default=10000.0, lo=0.0, strict=True),
            rope_freq_scale=read_rope_freq_scale(gf, arch),
            rope_attn_factor=read_float(gf, key(Keys.Rope.SCALING_ATTN_FACTOR), default=1.0, lo=0.0, strict=True),
            n_rot=read_int(gf, key(Keys.Rope.DIMENSION_COUNT), default=head_dim, lo=0),
            rope_neox=True,
            swa_layers=(False,) * n_layer,
        )
        args.update(overrides)
        return cls(**args)

    def key(self, template: str) -> str:
        """The metadata key of a gguf.Keys template for this architecture."""
        return template.format(arch=self.arch)

    def check(self, gf: GGUFFile) -> None:
        """Hold the hyperparameters to each other (module docstring, step 2; the tensor loader,
        edge.models.weights, then holds every declared tensor to the shape :meth:`dim` gives).

        Raises GGUFError naming the key, its value and what it must agree with.
        """
        k = self.key
        check_block_count(gf, k(Keys.LLM.BLOCK_COUNT), self.n_layer)
        if len(self.swa_layers) != self.n_layer:
            raise GGUFError(f"{gf.path}: {len(self.swa_layers)} sliding-window flags for {self.n_layer} layers")
        h, h_kv = k(Keys.Attention.HEAD_COUNT), k(Keys.Attention.HEAD_COUNT_KV)
        if self.n_head % self.n_head_kv:
            raise GGUFError(f"{gf.path}: {h_kv} = {self.n_head_kv} does not divide {h} = {self.n_head}")
        rot = _shown(gf, k(Keys.Rope.DIMENSION_COUNT), self.n_rot)
        kl = _shown(gf, k(Keys.Attention.KEY_LENGTH), self.head_dim)
        if not self.partial_rope and self.n_rot != self.head_dim:
            raise GGUFError(f"{gf.path}: {rot} must equal the head size {kl} for {self.arch}")
        if not (0 < self.n_rot <= self.head_dim and self.n_rot % 2 == 0):
            raise GGUFError(f"{gf.path}: {rot} must be even and at most the head size {kl}")

    def dim(self, expr: str) -> tuple[str, int]:
        """A tensor dimension written in these fields, e.g. ``"n_embd"``, ``"n_head * head_dim"``,
        ``"n_rot / 2"`` (+, -, * and exact /): (its text for a message, naming the metadata
        keys, as ``attention.head_count * attention.key_length = 4 * 64 = 256``; its value).

        Raises ValueError for an expression of anything else (a fault of the declaring code).
        """
        tree = _parse_dim(expr)
        value = _eval_dim(tree, self)
        names = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)]
        if names == ["n_vocab"]:
            return f"the {value} tokens of {TOKENS_KEY}", value
        keys = ast.unparse(_NameTo(lambda n: ast.Name(self.key(self.KEYS[n]))).visit(_parse_dim(expr)))
        if len(names) == 1:
            return f"{keys} = {value}", value
        values = ast.unparse(_NameTo(lambda n: ast.Constant(getattr(self, n))).visit(_parse_dim(expr)))
        return f"{keys} = {values} = {value}", value


_DIM_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
            ast.Div: lambda a, b: a // b}


def _parse_dim(expr: str) -> ast.expr:
    """The syntax tree of a dimension expression (ModelArgs.dim)."""
    return ast.parse(expr, mode="eval").body


def _eval_dim(node: ast.expr, args: ModelArgs) -> int:
    if isinstance(node, ast.Name) and node.id in {f.name for f in fields(args)}:
        return int(getattr(args, node.id))
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _DIM_OPS:
        return _DIM_OPS[type(node.op)](_eval_dim(node.left, args), _eval_dim(node.right, args))
    raise ValueError(f"a tensor dimension is made of ModelArgs fields, integers and + - * /, "
                     f"not {ast.unparse(node)!r}")


class _NameTo(ast.NodeTransformer):
    """Replaces every name of a dimension expression by what ``make(name)`` gives."""

    def __init__(self, make):
        self.make = make

    def visit_Name(self, node: ast.Name) -> ast.expr:
        return self.make(node.id)
