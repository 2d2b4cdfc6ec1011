"""Phi-3 (``general.architecture = phi3``: Phi-3, Phi-3.5, Phi-4, Phi-4-mini). Mirrors llama.cpp's
llm_build_phi3 (llama_model_phi3::graph<false>; llama.cpp turns Phi's sliding window off, so
``attention.sliding_window`` is ignored here too):

- RMSNorm pre-norms and residuals as in llm_build_llama;
- one fused projection ``attn_qkv``: q, k and v are consecutive column ranges of its output;
- GPT-NeoX RoPE on the first rope.dimension_count dimensions of each head (Phi-4-mini turns
  3/4 of them), with LongRoPE when the file has ``rope_factors_short`` / ``rope_factors_long``:
  the context size picks the factors (edge.models.rope.LongRope) and cos/sin are multiplied by
  rope.scaling.attn_factor (the converter's sqrt(1 + ln(scale) / ln(n_ctx_orig)));
- q multiplied by 1/sqrt(head_dim) after RoPE, softmax scale 1;
- a fused gate|up FFN: ``ffn_up`` has 2 * n_ff rows, the first half the gate; down(silu(gate)
  * up) (build_ffn with LLM_FFN_SWIGLU, LLM_FFN_SEQ);
- the output tied to token_embd when ``output.weight`` is absent (Phi-4-mini).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from gguf import Keys

from edge.gguf_file import GGUFError, GGUFFile
from edge.models.hparams import ModelArgs, read_int
from edge.models.layers import Batch, Block, heads, rms_norm
from edge.models.rope import LongRope, Rope
from edge.models.transformer import EMBEDDING_AND_OUTPUT, Transformer
from edge.models.weights import Weight, optional, tensor
from kernels_cpu import ops

ARCH = "phi3"


@dataclass
class Phi3Args(ModelArgs):
    """ModelArgs plus q's scale after RoPE (``query_scale``, float32 1/sqrt(head_dim)) and
    LongRoPE's original context (``n_ctx_orig``: rope.scaling.original_context_length, default
    context_length)."""

    query_scale: float = 1.0
    n_ctx_orig: int = 0


def read_args(gf: GGUFFile) -> Phi3Args:
    """The hyperparameters (edge.models.hparams: every key checked). Raises GGUFError, also for
    a value_length other than key_length (llama.cpp asserts they are equal)."""
    args = Phi3Args.common_from_gguf(gf, ARCH, rope_neox=True, partial_rope=True)
    if args.head_dim_v != args.head_dim:
        raise GGUFError(f"{gf.path}: {args.key(Keys.Attention.VALUE_LENGTH)} = {args.head_dim_v} must equal "
                        f"{args.key(Keys.Attention.KEY_LENGTH)} = {args.head_dim} for {ARCH}")
    return replace(
        args, query_scale=float(np.float32(1) / np.sqrt(np.float32(args.head_dim))),
        n_ctx_orig=read_int(gf, args.key(Keys.Rope.SCALING_ORIG_CTX_LEN), default=args.n_ctx_train))


def project_fused_qkv(h: np.ndarray, wqkv: Weight, a: ModelArgs, b: Batch):
    """(q, k, v) f32[T, n_head | n_head_kv, head_dim], contiguous copies of the column ranges of
    h @ wqkv.T (build_qkv's fused path: views of one product)."""
    T = h.shape[0]
    nq, nk = a.n_head * a.head_dim, a.n_head_kv * a.head_dim
    qkv = wqkv(h, b.buf("qkv", (T, wqkv.n_out)), workspace=b.ws)
    q, k, v = b.buf("q", (T, nq)), b.buf("k", (T, nk)), b.buf("v", (T, nk))
    q[:], k[:], v[:] = qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]
    return heads(q, a.n_head), heads(k, a.n_head_kv), heads(v, a.n_head_kv)


def ffn_swiglu_fused(h: np.ndarray, up: Weight, down: Weight, b: Batch) -> np.ndarray:
    """down(silu(g) * u) with [g | u] = h @ up.T (build_ffn with LLM_FFN_SWIGLU, LLM_FFN_SEQ:
    ggml_swiglu of one tensor, the gate its first half): h f32[R, n_embd] -> f32[R, n_embd]
    (a scratch buffer)."""
    R, n = h.shape[0], up.n_out // 2
    gu = up(h, b.buf("u", (R, up.n_out)), workspace=b.ws)              # [R, 2 * n_ff]
    g = b.buf("g", (R, n))
    ops.silu_mul(gu[:, :n], gu[:, n:], g)
    return down(g, b.buf("d", (R, down.n_out)), workspace=b.ws)


class Phi3Block(Block):
    """One layer of llm_build_phi3 (module docstring)."""

    def __init__(self, w: dict, a: Phi3Args, il: int, rope: Rope | LongRope):
        super().__init__(w, a, il)
        self.rope = rope
        self.kq_scale = np.float32(1.0)                                    # q is scaled instead

    def __call__(self, x: np.ndarray, b: Batch) -> np.ndarray | None:
        a = self.args
        h = rms_norm(x, self.attn_norm, a.rms_eps, b.buf("h", x.shape))
        q, k, v = project_fused_qkv(h, self.attn_qkv, a, b)
        self.rope(q, b)
        self.rope(k, b)
        q *= np.float32(a.query_scale)
        o = self.attend(q, k, v, b)                                        # [rows, n_embd]
        if o is None:
            return None                                                    # only K/V were wanted
        x = b.keep(x)
        x += o
        h = rms_norm(x, self.ffn_norm, a.rms_eps, b.buf("h", x.shape))
        x += ffn_swiglu_fused(h, self.ffn_up, self.ffn_down, b)
        return x


class Phi3(Transformer):
    TENSORS = [*EMBEDDING_AND_OUTPUT, optional("rope_factors_long.weight", "n_rot / 2"),
               optional("rope_factors_short.weight", "n_rot / 2")]
    LAYER_TENSORS = [
        tensor("attn_norm.weight", "n_embd"),
        tensor("attn_qkv.weight", "n_embd", "n_head * head_dim + 2 * n_head_kv * head_dim"),
        tensor("attn_output.weight", "n_head * head_dim", "n_embd"),
        tensor("ffn_norm.weight", "n_embd"),
        tensor("ffn_up.weight", "n_embd", "2 * n_ff"),
        tensor("ffn_down.weight", "n_ff", "n_embd"),
    ]

    def build_blocks(self, layers):
        a = self.args

        def rope(factors):
            return Rope(a.n_rot, a.rope_freq_base, a.rope_freq_scale, neox=True, freq_factors=factors,
                        attn_factor=a.rope_attn_factor)
        if self.rope_factors_short is None and self.rope_factors_long is None:
            r = rope(None)
        else:                        # llama.cpp: a factor tensor the file lacks is no factors
            r = LongRope(rope(self.rope_factors_short), rope(self.rope_factors_long), a.n_ctx_orig)
        return [Phi3Block(w, a, il, r) for il, w in enumerate(layers)]


def load(gf: GGUFFile) -> Phi3:
    """The model of a phi3 file. Raises GGUFError naming a bad key or tensor."""
    return Phi3(gf, read_args(gf))
