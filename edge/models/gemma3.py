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
import math
from dataclasses import replace

import numpy as np
from gguf import Keys

from edge.gguf_file import GGUFError, GGUFFile
from edge.models.common import Transformer
from edge.models.hparams import ModelArgs, UINT32_MAX, read_float, read_int, read_swa_layers

ARCH = "gemma3"
SWA_PATTERN = 6  # llama.cpp: hparams.set_swa_pattern(6) for gemma3
N_LAYER_27B = 62


def load(gf: GGUFFile) -> Transformer:
    args = ModelArgs.common_from_gguf(gf, ARCH, rope_neox=True, partial_rope=True, qk_norm=True,
                                      post_norms=True, activation="gelu", attention_scale=1.0)
    window = read_int(gf, Keys.Attention.SLIDING_WINDOW.format(arch=ARCH), default=0, lo=0, hi=UINT32_MAX)
    n_embd, n_head = args.n_embd, args.n_head
    # float32 as llama.cpp: 1.0f / std::sqrt(float(n)), n an integer quotient for the 27B model
    n = n_embd // n_head if args.n_layer == N_LAYER_27B else args.head_dim
    if n == 0:
        raise GGUFError(f"{gf.path}: {args.key(Keys.Attention.HEAD_COUNT)} = {n_head} is more than "
                        f"{args.key(Keys.LLM.EMBEDDING_LENGTH)} = {n_embd}")
    scale = float(np.float32(1) / np.sqrt(np.float32(n)))
    args = replace(
        args, embed_scale=math.sqrt(n_embd), query_scale=scale, sliding_window=window,
        swa_layers=read_swa_layers(gf, ARCH, args.n_layer, window, SWA_PATTERN),
        rope_freq_base_swa=read_float(gf, Keys.Rope.FREQ_BASE_SWA.format(arch=ARCH), default=10000.0,
                                      lo=0.0, strict=True),
        final_logit_softcap=read_float(gf, Keys.LLM.FINAL_LOGIT_SOFTCAPPING.format(arch=ARCH), default=0.0),
    )
    return Transformer(gf, args)
