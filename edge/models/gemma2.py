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
from dataclasses import replace

from gguf import Keys

from edge.gguf_file import GGUFFile
from edge.models.gemma3 import Gemma3, Gemma3Args, Gemma3Block, query_scale
from edge.models.hparams import UINT32_MAX, read_float, read_int, read_swa_layers
from edge.models.layers import ATTENTION_TENSORS, GATED_FFN_TENSORS
from edge.models.rope import Rope
from edge.models.transformer import EMBEDDING_AND_OUTPUT
from edge.models.weights import tensor

ARCH = "gemma2"
SWA_PATTERN = 2          # llama.cpp: load_swa_pattern(ml, 2) for gemma2
DEFAULT_WINDOW = 4096    # llama.cpp: hparams.n_swa = 4096, "default value of gemma 2"
N_LAYER_27B = 46


def read_args(gf: GGUFFile) -> Gemma3Args:
    """The hyperparameters (edge.models.hparams: every key checked), in Gemma3Args with
    ``attn_softcap``. Raises GGUFError."""
    args = Gemma3Args.common_from_gguf(gf, ARCH, rope_neox=True, partial_rope=True)
    key = args.key
    window = read_int(gf, key(Keys.Attention.SLIDING_WINDOW), default=DEFAULT_WINDOW, lo=0, hi=UINT32_MAX)
    return replace(
        args, embed_scale=math.sqrt(args.n_embd), query_scale=query_scale(gf, args, N_LAYER_27B),
        sliding_window=window, swa_layers=read_swa_layers(gf, ARCH, args.n_layer, window, SWA_PATTERN),
        rope_freq_base_swa=read_float(gf, key(Keys.Rope.FREQ_BASE_SWA), default=args.rope_freq_base,
                                      lo=0.0, strict=True),
        rope_freq_scale_swa=args.rope_freq_scale,
        attn_softcap=read_float(gf, key(Keys.LLM.ATTN_LOGIT_SOFTCAPPING), default=50.0, lo=0.0, strict=True),
        final_logit_softcap=read_float(gf, key(Keys.LLM.FINAL_LOGIT_SOFTCAPPING), default=30.0, lo=0.0,
                                       strict=True),
    )


class Gemma2(Gemma3):
    """Gemma3's embeddings, logits (scaled, soft-capped) and block (edge.models.gemma3.Gemma3Block,
    here without q/k norms and with the attention scores soft-capped)."""

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
        return [Gemma3Block(w, a, il, local if a.swa_layers[il] else glob) for il, w in enumerate(layers)]


def load(gf: GGUFFile) -> Gemma2:
    """The model of a gemma2 file. Raises GGUFError naming a bad key or tensor."""
    return Gemma2(gf, read_args(gf))
