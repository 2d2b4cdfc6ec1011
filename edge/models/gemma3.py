"""Gemma 3 (``general.architecture = gemma3``). Mirrors llama.cpp's llm_build_gemma3_iswa:

- token embeddings scaled by sqrt(n_embd);
- per-head RMSNorm of q and k (attn_q_norm, attn_k_norm), NeoX RoPE, q (not the scores)
  scaled by 1/sqrt(head_dim) (1/sqrt(n_embd/n_head) for the 27B model), softmax scale 1;
- post-attention and post-FFN RMSNorms (post_attention_norm, post_ffw_norm);
- GELU (tanh approximation) gated FFN;
- sliding-window attention (``attention.sliding_window`` tokens) on all layers but every
  6th (pattern from ``attention.sliding_window_pattern`` when present), with RoPE base 10000
  on the local layers and ``rope.freq_base`` (and linear scaling) on the global ones;
- optional final logit soft-capping; output tied to token_embd.
Norm weights in Gemma GGUFs already include the +1 of Gemma's RMSNorm (added at conversion).
"""
import math

import numpy as np

from edge.gguf_file import GGUFFile
from edge.models.common import ModelArgs, Transformer

SWA_PATTERN = 6  # llama.cpp: hparams.set_swa_pattern(6) for gemma3
N_LAYER_27B = 62


def load(gf: GGUFFile) -> Transformer:
    k = "gemma3."
    n_layer = gf.get_int(k + "block_count")
    n_embd = gf.get_int(k + "embedding_length")
    n_head = gf.get_int(k + "attention.head_count")
    head_dim = gf.get_int(k + "attention.key_length", default=n_embd // n_head)
    window = gf.get_int(k + "attention.sliding_window", default=0)
    pattern = gf.get_int(k + "attention.sliding_window_pattern", default=SWA_PATTERN)
    swa = tuple(window > 0 and il % pattern < pattern - 1 for il in range(n_layer))
    # float32 as llama.cpp: 1.0f / std::sqrt(float(n)), n an integer quotient for the 27B model
    scale = float(np.float32(1) / np.sqrt(np.float32(n_embd // n_head if n_layer == N_LAYER_27B else head_dim)))
    args = ModelArgs.common_from_gguf(
        gf, "gemma3", rope_neox=True, qk_norm=True, post_norms=True, activation="gelu",
        embed_scale=math.sqrt(n_embd), query_scale=scale, attention_scale=1.0, sliding_window=window,
        swa_layers=swa, rope_freq_base_swa=10000.0, rope_freq_scale_swa=1.0,
        final_logit_softcap=gf.get_float(k + "final_logit_softcapping", default=0.0),
    )
    return Transformer(gf, args)
