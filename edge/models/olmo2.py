"""OLMo 2 (``general.architecture = olmo2``; OLMo 3 files too). Mirrors llama.cpp's olmo2 graph
(llm_build_olmo2; in llama.cpp 0.3.36 ``llama_model_olmo2::graph``, src/models/olmo2.cpp):

- no norm before attention or the FFN: q, k, v are projected from the layer input itself;
- RMSNorm of q and of k over the whole projection (attn_q_norm f32[n_head * head_dim],
  attn_k_norm f32[n_head_kv * head_dim]), before the split into heads and NeoX RoPE;
- the attention output and the FFN output RMSNormed (post_attention_norm, post_ffw_norm)
  before their residual adds; SwiGLU FFN; ``output.weight`` required (not tied);
- with ``attention.sliding_window`` (OLMo 3), sliding-window layers by
  ``attention.sliding_window_pattern`` (default 4: every 4th layer global) whose RoPE has
  frequency scale 1 (the global layers' scaling is not applied; the base is the same).
"""
from __future__ import annotations

import numpy as np
from gguf import Keys

from edge.gguf_file import GGUFFile
from edge.models.hparams import ModelArgs, UINT32_MAX, read_int, read_swa_layers
from edge.models.layers import (ATTENTION_TENSORS, Batch, Block, ffn_swiglu, heads, project_qkv, rms_norm)
from edge.models.rope import Rope
from edge.models.transformer import Transformer
from edge.models.weights import tensor

ARCH = "olmo2"
SWA_PATTERN = 4   # llama.cpp: load_swa_pattern(ml, 4) for olmo2


def read_args(gf: GGUFFile) -> ModelArgs:
    """The hyperparameters (edge.models.hparams: every key checked). Raises GGUFError."""
    args = ModelArgs.common_from_gguf(gf, ARCH, rope_neox=True)
    window = read_int(gf, Keys.Attention.SLIDING_WINDOW.format(arch=ARCH), default=0, lo=0, hi=UINT32_MAX)
    args.sliding_window = window
    args.swa_layers = read_swa_layers(gf, ARCH, args.n_layer, window, SWA_PATTERN)
    return args


class Olmo2Block(Block):
    """One layer of llm_build_olmo2 (module docstring)."""

    def __init__(self, w: dict, a: ModelArgs, il: int, rope: Rope):
        super().__init__(w, a, il)
        self.rope = rope

    def __call__(self, x: np.ndarray, b: Batch) -> np.ndarray | None:
        a = self.args
        q, k, v = project_qkv(x, self.attn_q, self.attn_k, self.attn_v, b)
        rms_norm(q, self.attn_q_norm, a.rms_eps, q)                        # Qcur_normed
        rms_norm(k, self.attn_k_norm, a.rms_eps, k)                        # Kcur_normed
        q, k, v = heads(q, a.n_head), heads(k, a.n_head_kv), heads(v, a.n_head_kv)
        self.rope(q, b)
        self.rope(k, b)
        o = self.attend(q, k, v, b)                                        # [rows, n_embd]
        if o is None:
            return None                                                    # only K/V were wanted
        x = b.keep(x)
        x += rms_norm(o, self.post_attention_norm, a.rms_eps, o)          # ffn_inp
        d = ffn_swiglu(x, self.ffn_gate, self.ffn_up, self.ffn_down, b)
        x += rms_norm(d, self.post_ffw_norm, a.rms_eps, d)
        return x


class Olmo2(Transformer):
    TENSORS = [tensor("token_embd.weight", "n_embd", "n_vocab"), tensor("output_norm.weight", "n_embd"),
               tensor("output.weight", "n_embd", "n_vocab")]
    LAYER_TENSORS = [
        *[t for t in ATTENTION_TENSORS if t.name != "attn_norm.weight"],  # no pre-attention norm
        tensor("attn_q_norm.weight", "n_head * head_dim"),
        tensor("attn_k_norm.weight", "n_head_kv * head_dim"),
        tensor("post_attention_norm.weight", "n_embd"),
        tensor("ffn_gate.weight", "n_embd", "n_ff"),
        tensor("ffn_up.weight", "n_embd", "n_ff"),
        tensor("ffn_down.weight", "n_ff", "n_embd"),
        tensor("post_ffw_norm.weight", "n_embd"),
    ]

    def build_blocks(self, layers):
        a = self.args
        glob = Rope(a.n_rot, a.rope_freq_base, a.rope_freq_scale, neox=True)
        local = Rope(a.n_rot, a.rope_freq_base, 1.0, neox=True)
        return [Olmo2Block(w, a, il, local if a.swa_layers[il] else glob) for il, w in enumerate(layers)]


def load(gf: GGUFFile) -> Olmo2:
    """The model of an olmo2 file. Raises GGUFError naming a bad key or tensor."""
    return Olmo2(gf, read_args(gf))
