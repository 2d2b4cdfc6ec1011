"""Gemma 3 (``general.architecture = gemma3``). Mirrors llama.cpp's llm_build_gemma3_iswa:

- token embeddings scaled by sqrt(n_embd);
- per-head RMSNorm of q and k (attn_q_norm, attn_k_norm), NeoX RoPE, q (not the scores)
  scaled by 1/sqrt(head_dim) (1/sqrt(n_embd/n_head) for the 27B model), softmax scale 1;
- post-attention and post-FFN RMSNorms (post_attention_norm, post_ffw_norm);
- GELU (tanh approximation) gated FFN;
- sliding-window attention (``attention.sliding_window`` tokens) on all layers but every
  6th (pattern from ``attention.sliding_window_pattern`` when present), with RoPE base
  ``rope.freq_base_swa`` (default 10000) on the local layers and ``rope.freq_base`` (and
  linear scaling) on the global ones;
- optional final logit soft-capping; output tied to token_embd.
Norm weights in Gemma GGUFs already include the +1 of Gemma's RMSNorm (added at conversion).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from gguf import Keys

from edge.gguf_file import GGUFError, GGUFFile
from edge.models.hparams import ModelArgs, UINT32_MAX, read_float, read_int, read_swa_layers
from edge.models.layers import (ATTENTION_TENSORS, GATED_FFN_TENSORS, Batch, Block, ffn_geglu, heads, project_qkv,
                                rms_norm, rms_norm_heads)
from edge.models.rope import Rope
from edge.models.transformer import EMBEDDING_AND_OUTPUT, Transformer
from edge.models.weights import optional, tensor
from kernels_cpu import ops

ARCH = "gemma3"
SWA_PATTERN = 6  # llama.cpp: hparams.set_swa_pattern(6) for gemma3
N_LAYER_27B = 62


@dataclass
class Gemma3Args(ModelArgs):
    """ModelArgs plus Gemma's scales: embeddings times ``embed_scale``, q times ``query_scale``
    after RoPE (llama.cpp's f_attention_scale), logits soft-capped at ``final_logit_softcap``
    (0: not)."""

    embed_scale: float = 1.0
    query_scale: float = 1.0
    final_logit_softcap: float = 0.0
    attn_softcap: float = 0.0      # soft-capping of the attention scores (Gemma 2); 0: none


def query_scale(gf: GGUFFile, args: ModelArgs, n_layer_27b: int) -> float:
    """llama.cpp's f_attention_scale of Gemma 2/3, float32 ``1.0f / std::sqrt(float(n))``: n is
    head_dim, or the integer quotient n_embd / n_head for the 27B model (``n_layer_27b``
    layers). Raises GGUFError when that quotient is 0."""
    n = args.n_embd // args.n_head if args.n_layer == n_layer_27b else args.head_dim
    if n == 0:
        raise GGUFError(f"{gf.path}: {args.key(Keys.Attention.HEAD_COUNT)} = {args.n_head} is more than "
                        f"{args.key(Keys.LLM.EMBEDDING_LENGTH)} = {args.n_embd}")
    return float(np.float32(1) / np.sqrt(np.float32(n)))


def read_args(gf: GGUFFile) -> Gemma3Args:
    """The hyperparameters (edge.models.hparams: every key checked). Raises GGUFError."""
    args = Gemma3Args.common_from_gguf(gf, ARCH, rope_neox=True, partial_rope=True)
    window = read_int(gf, Keys.Attention.SLIDING_WINDOW.format(arch=ARCH), default=0, lo=0, hi=UINT32_MAX)
    return replace(
        args, embed_scale=math.sqrt(args.n_embd), query_scale=query_scale(gf, args, N_LAYER_27B),
        sliding_window=window,
        swa_layers=read_swa_layers(gf, ARCH, args.n_layer, window, SWA_PATTERN),
        rope_freq_base_swa=read_float(gf, Keys.Rope.FREQ_BASE_SWA.format(arch=ARCH), default=10000.0,
                                      lo=0.0, strict=True),
        final_logit_softcap=read_float(gf, Keys.LLM.FINAL_LOGIT_SOFTCAPPING.format(arch=ARCH), default=0.0),
    )


class Gemma3Block(Block):
    """One layer of llm_build_gemma3_iswa (module docstring); local (sliding-window) layers
    have their own RoPE. Without attn_q_norm/attn_k_norm and with ``attn_softcap`` it is the
    layer of llm_build_gemma2_iswa (edge.models.gemma2)."""

    def __init__(self, w: dict, a: Gemma3Args, il: int, rope: Rope):
        super().__init__({"attn_q_norm": None, "attn_k_norm": None, **w}, a, il)
        self.rope = rope
        self.kq_scale = np.float32(1.0)                                    # q is scaled instead
        self.softcap = a.attn_softcap

    def __call__(self, x: np.ndarray, b: Batch) -> np.ndarray | None:
        a = self.args
        h = rms_norm(x, self.attn_norm, a.rms_eps, b.buf("h", x.shape))
        q, k, v = project_qkv(h, self.attn_q, self.attn_k, self.attn_v, b)
        q, k, v = heads(q, a.n_head), heads(k, a.n_head_kv), heads(v, a.n_head_kv)
        if self.attn_q_norm is not None:
            rms_norm_heads(q, self.attn_q_norm, a.rms_eps)
            rms_norm_heads(k, self.attn_k_norm, a.rms_eps)
        self.rope(q, b)
        self.rope(k, b)
        q *= np.float32(a.query_scale)
        o = self.attend(q, k, v, b)                                        # [rows, n_embd]
        if o is None:
            return None                                                    # only K/V were wanted
        x = b.keep(x)
        x += rms_norm(o, self.post_attention_norm, a.rms_eps, o)
        h = rms_norm(x, self.ffn_norm, a.rms_eps, b.buf("h", x.shape))
        d = ffn_geglu(h, self.ffn_gate, self.ffn_up, self.ffn_down, b)
        x += rms_norm(d, self.post_ffw_norm, a.rms_eps, d)
        return x


class Gemma3(Transformer):
    TENSORS = [*EMBEDDING_AND_OUTPUT, optional("rope_freqs.weight", "n_rot / 2")]
    LAYER_TENSORS = [
        *ATTENTION_TENSORS,
        tensor("attn_q_norm.weight", "head_dim"),
        tensor("attn_k_norm.weight", "head_dim"),
        tensor("post_attention_norm.weight", "n_embd"),
        *GATED_FFN_TENSORS,
        tensor("post_ffw_norm.weight", "n_embd"),
    ]

    def build_blocks(self, layers):
        a = self.args
        glob = Rope(a.n_rot, a.rope_freq_base, a.rope_freq_scale, neox=True, freq_factors=self.rope_freqs,
                    attn_factor=a.rope_attn_factor)
        local = Rope(a.n_rot, a.rope_freq_base_swa, a.rope_freq_scale_swa, neox=True, attn_factor=a.rope_attn_factor)
        return [Gemma3Block(w, a, il, local if a.swa_layers[il] else glob) for il, w in enumerate(layers)]

    def embed(self, tokens):
        x = super().embed(tokens)
        x *= np.float32(self.args.embed_scale)
        return x

    def logits(self, x):
        out = super().logits(x)
        if self.args.final_logit_softcap:
            ops.softcap(out, self.args.final_logit_softcap)
        return out


def load(gf: GGUFFile) -> Gemma3:
    """The model of a gemma3 file. Raises GGUFError naming a bad key or tensor."""
    return Gemma3(gf, read_args(gf))
