"""Gemma 2 (``general.architecture = gemma2``). Mirrors llama.cpp's llm_build_gemma2_iswa
(llama_model_gemma2::graph):

- token embeddings scaled by sqrt(n_embd);
- NeoX RoPE, q (not the scores) scaled by 1/sqrt(head_dim) (1/sqrt(n_embd/n_head) for the
  27B model, 46 layers), softmax scale 1;
- attention scores soft-capped before the softmax, ``attn_logit_softcapping`` * tanh(kq /
  attn_logit_softcapping) (default 50), and the logits at ``final_logit_softcapping``
  (default 30), both always on as in llama.cpp;
- post-attention and post-FFN RMSNorms (post_attention_norm, post_ffw_norm);
- GELU (tanh approximation) gated FFN;
- sliding-window attention (``attention.sliding_window`` tokens, default 4096) on alternate
  layers: every 2nd layer global from layer 1 (``attention.sliding_window_pattern`` when
  present), the local layers with RoPE base ``rope.freq_base_swa`` (default rope.freq_base)
  and the global ones's frequency scale;
- output tied to token_embd (an output.weight, which llama.cpp's converter never writes, is
  used if present, as for gemma3).
Norm weights in Gemma GGUFs already include the +1 of Gemma's RMSNorm (added at conversion).
A soft-capping value of 0 is refused (llama.cpp divides by it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from gguf import Keys

from edge.gguf_file import GGUFError, GGUFFile
from edge.models.hparams import UINT32_MAX, read_float, read_int, read_swa_layers
from edge.models.layers import (ATTENTION_TENSORS, GATED_FFN_TENSORS, Batch, Block, ffn_geglu, heads, project_qkv,
                                rms_norm)
from edge.models.rope import Rope
from edge.models.gemma3 import Gemma3, Gemma3Args
from edge.models.transformer import EMBEDDING_AND_OUTPUT
from edge.models.weights import tensor

ARCH = "gemma2"
SWA_PATTERN = 2          # llama.cpp: load_swa_pattern(ml, 2) for gemma2
DEFAULT_WINDOW = 4096    # llama.cpp: hparams.n_swa = 4096, "default value of gemma 2"
N_LAYER_27B = 46


@dataclass
class Gemma2Args(Gemma3Args):
    """Gemma3Args (embed_scale, query_scale, final_logit_softcap) plus the attention scores'
    soft-capping ``attn_softcap``."""

    attn_softcap: float = 50.0


def read_args(gf: GGUFFile) -> Gemma2Args:
    """The hyperparameters (edge.models.hparams: every key checked). Raises GGUFError."""
    args = Gemma2Args.common_from_gguf(gf, ARCH, rope_neox=True, partial_rope=True)
    key = args.key
    window = read_int(gf, key(Keys.Attention.SLIDING_WINDOW), default=DEFAULT_WINDOW, lo=0, hi=UINT32_MAX)
    # float32 as llama.cpp: 1.0f / std::sqrt(float(n)), n an integer quotient for the 27B model
    n = args.n_embd // args.n_head if args.n_layer == N_LAYER_27B else args.head_dim
    if n == 0:
        raise GGUFError(f"{gf.path}: {key(Keys.Attention.HEAD_COUNT)} = {args.n_head} is more than "
                        f"{key(Keys.LLM.EMBEDDING_LENGTH)} = {args.n_embd}")
    return replace(
        args, embed_scale=math.sqrt(args.n_embd), query_scale=float(np.float32(1) / np.sqrt(np.float32(n))),
        sliding_window=window, swa_layers=read_swa_layers(gf, ARCH, args.n_layer, window, SWA_PATTERN),
        rope_freq_base_swa=read_float(gf, key(Keys.Rope.FREQ_BASE_SWA), default=args.rope_freq_base,
                                      lo=0.0, strict=True),
        rope_freq_scale_swa=args.rope_freq_scale,
        attn_softcap=read_float(gf, key(Keys.LLM.ATTN_LOGIT_SOFTCAPPING), default=50.0, lo=0.0, strict=True),
        final_logit_softcap=read_float(gf, key(Keys.LLM.FINAL_LOGIT_SOFTCAPPING), default=30.0, lo=0.0,
                                       strict=True),
    )


class Gemma2Block(Block):
    """One layer of llm_build_gemma2_iswa (module docstring); local (sliding-window) layers
    have their own RoPE."""

    def __init__(self, w: dict, a: Gemma2Args, il: int, rope: Rope):
        super().__init__(w, a, il)
        self.rope = rope
        self.kq_scale = np.float32(1.0)                                    # q is scaled instead
        self.softcap = a.attn_softcap

    def __call__(self, x: np.ndarray, b: Batch) -> np.ndarray | None:
        a = self.args
        h = rms_norm(x, self.attn_norm, a.rms_eps, b.buf("h", x.shape))
        q, k, v = project_qkv(h, self.attn_q, self.attn_k, self.attn_v, b)
        q, k, v = heads(q, a.n_head), heads(k, a.n_head_kv), heads(v, a.n_head_kv)
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


class Gemma2(Gemma3):
    """Gemma3's embeddings and logits (scaled, soft-capped) around Gemma2Block."""

    TENSORS = EMBEDDING_AND_OUTPUT
    LAYER_TENSORS = [
        *ATTENTION_TENSORS,
        tensor("post_attention_norm.weight", "n_embd"),
        *GATED_FFN_TENSORS,
        tensor("post_ffw_norm.weight", "n_embd"),
    ]

    def build_blocks(self, layers):
        a = self.args
        glob = Rope(a.n_rot, a.rope_freq_base, a.rope_freq_scale, neox=True, attn_factor=a.rope_attn_factor)
        local = Rope(a.n_rot, a.rope_freq_base_swa, a.rope_freq_scale_swa, neox=True, attn_factor=a.rope_attn_factor)
        return [Gemma2Block(w, a, il, local if a.swa_layers[il] else glob) for il, w in enumerate(layers)]


def load(gf: GGUFFile) -> Gemma2:
    """The model of a gemma2 file. Raises GGUFError naming a bad key or tensor."""
    return Gemma2(gf, read_args(gf))
