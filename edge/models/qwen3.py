"""Qwen3 (``general.architecture = qwen3``). Mirrors llama.cpp's qwen3 graph (llm_build_qwen3;
in llama.cpp 0.3.36 ``llama_model_qwen3::graph``, src/models/qwen3.cpp):

- RMSNorm before attention and before the FFN, residuals after each;
- q, k, v projections without biases; ``attention.key_length`` may differ from n_embd / n_head
  (Qwen3 0.6B: 16 heads of 128 on n_embd 1024);
- per-head RMSNorm of q and k (attn_q_norm, attn_k_norm, over head_dim) before RoPE;
- GPT-NeoX RoPE over the whole head (rope.dimension_count = head_dim), softmax scale
  1/sqrt(head_dim);
- SwiGLU FFN; output tied to token_embd when ``output.weight`` is absent.
"""
from __future__ import annotations

import numpy as np

from edge.gguf_file import GGUFFile
from edge.models.hparams import ModelArgs
from edge.models.layers import (ATTENTION_TENSORS, GATED_FFN_TENSORS, Batch, Block, ffn_swiglu, heads, project_qkv,
                                rms_norm, rms_norm_heads)
from edge.models.rope import Rope
from edge.models.transformer import EMBEDDING_AND_OUTPUT, Transformer
from edge.models.weights import tensor

ARCH = "qwen3"

# the per-head q/k norms of qwen3 and qwen3moe
QK_NORM_TENSORS = [tensor("attn_q_norm.weight", "head_dim"), tensor("attn_k_norm.weight", "head_dim")]


def read_args(gf: GGUFFile, arch: str = ARCH) -> ModelArgs:
    """The hyperparameters (edge.models.hparams: every key checked). Raises GGUFError."""
    return ModelArgs.common_from_gguf(gf, arch, rope_neox=True)


class Qwen3Block(Block):
    """One layer of llm_build_qwen3 (module docstring). The FFN is :meth:`ffn`, which
    edge.models.qwen3moe's block replaces by its experts."""

    def __init__(self, w: dict, a: ModelArgs, il: int, rope: Rope):
        super().__init__(w, a, il)
        self.rope = rope

    def __call__(self, x: np.ndarray, b: Batch) -> np.ndarray | None:
        a = self.args
        h = rms_norm(x, self.attn_norm, a.rms_eps, b.buf("h", x.shape))
        q, k, v = project_qkv(h, self.attn_q, self.attn_k, self.attn_v, b)
        q, k, v = heads(q, a.n_head), heads(k, a.n_head_kv), heads(v, a.n_head_kv)
        rms_norm_heads(q, self.attn_q_norm, a.rms_eps)                     # Qcur_normed
        rms_norm_heads(k, self.attn_k_norm, a.rms_eps)                     # Kcur_normed
        self.rope(q, b)
        self.rope(k, b)
        o = self.attend(q, k, v, b)                                        # [rows, n_embd]
        if o is None:
            return None                                                    # only K/V were wanted
        x = b.keep(x)
        x += o                                                             # ffn_inp
        h = rms_norm(x, self.ffn_norm, a.rms_eps, b.buf("h", x.shape))
        x += self.ffn(h, b)
        return x

    def ffn(self, h: np.ndarray, b: Batch) -> np.ndarray:
        """The feed-forward of the normed rows h f32[R, n_embd] -> f32[R, n_embd] (scratch)."""
        return ffn_swiglu(h, self.ffn_gate, self.ffn_up, self.ffn_down, b)


class Qwen3(Transformer):
    TENSORS = EMBEDDING_AND_OUTPUT
    LAYER_TENSORS = [*ATTENTION_TENSORS, *QK_NORM_TENSORS, *GATED_FFN_TENSORS]
    BLOCK = Qwen3Block

    def build_blocks(self, layers):
        a = self.args
        rope = Rope(a.n_rot, a.rope_freq_base, a.rope_freq_scale, neox=True)
        return [self.BLOCK(w, a, il, rope) for il, w in enumerate(layers)]


def load(gf: GGUFFile) -> Qwen3:
    """The model of a qwen3 file. Raises GGUFError naming a bad key or tensor."""
    return Qwen3(gf, read_args(gf))
