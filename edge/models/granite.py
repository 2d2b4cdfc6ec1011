"""IBM Granite 3.x dense models (``general.architecture = granite``). Mirrors llama.cpp's
llm_build_granite (llama_model_granite::graph, without MoE and deepstack): llm_build_llama's
graph (RMSNorm, SwiGLU FFN, llama's NORM RoPE pairing, optional QKV biases and ``rope_freqs``,
output tied to token_embd when ``output.weight`` is absent) with four multipliers:

- ``embedding_scale``: the token embeddings times it (0 or absent: not scaled);
- ``residual_scale``: the attention and the FFN outputs times it before each residual add
  (0 or absent: not scaled);
- ``attention.scale``: the softmax scale of the scores (0 or absent: 1/sqrt(head_dim));
- ``logit_scale`` (required): the logits divided by it (times float32 1/logit_scale).

``rope.scaling.finetuned`` = false turns RoPE off (llama.cpp reads it as Granite's RoPE
switch, default true). A logit_scale of 0 is refused (llama.cpp divides by it).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from gguf import Keys

from edge.gguf_file import GGUFFile
from edge.models.hparams import ModelArgs, read_float
from edge.models.layers import Batch, Block, ffn_swiglu, heads, project_qkv, rms_norm
from edge.models.llama import Llama
from edge.models.rope import Rope, static_k_bias

ARCH = "granite"


@dataclass
class GraniteArgs(ModelArgs):
    """ModelArgs plus Granite's multipliers (module docstring; 0: not applied) and ``rope``
    (rope.scaling.finetuned: RoPE on)."""

    embedding_scale: float = 0.0
    residual_scale: float = 0.0
    attention_scale: float = 0.0
    logit_scale: float = 1.0
    rope: bool = True


def read_args(gf: GGUFFile) -> GraniteArgs:
    """The hyperparameters (edge.models.hparams: every key checked). Raises GGUFError."""
    args = GraniteArgs.common_from_gguf(gf, ARCH, rope_neox=False)
    key = args.key
    return replace(
        args,
        embedding_scale=read_float(gf, key(Keys.LLM.EMBEDDING_SCALE), default=0.0),
        residual_scale=read_float(gf, key(Keys.LLM.RESIDUAL_SCALE), default=0.0),
        attention_scale=read_float(gf, key(Keys.Attention.SCALE), default=0.0),
        logit_scale=read_float(gf, key(Keys.LLM.LOGIT_SCALE), lo=0.0, strict=True),
        rope=gf.get_bool(key(Keys.Rope.SCALING_FINETUNED), default=True),
    )


class GraniteBlock(Block):
    """One layer of llm_build_granite (module docstring): llama's layer with the residual
    multiplier and Granite's softmax scale; no RoPE when ``rope`` is None."""

    def __init__(self, w: dict, a: GraniteArgs, il: int, rope: Rope | None):
        super().__init__(w, a, il)
        self.rope = rope
        if a.attention_scale:
            self.kq_scale = np.float32(a.attention_scale)
        if self.attn_k_bias is not None and rope is not None:
            self.k_shift = static_k_bias(a, self.attn_k_bias, False, rope.freq_factors)

    def __call__(self, x: np.ndarray, b: Batch) -> np.ndarray | None:
        a = self.args
        h = rms_norm(x, self.attn_norm, a.rms_eps, b.buf("h", x.shape))
        q, k, v = project_qkv(h, self.attn_q, self.attn_k, self.attn_v, b)
        if self.attn_q_bias is not None:
            q += self.attn_q_bias
            k += self.attn_k_bias
            v += self.attn_v_bias
        q, k, v = heads(q, a.n_head), heads(k, a.n_head_kv), heads(v, a.n_head_kv)
        if self.rope is not None:
            self.rope(q, b)
            self.rope(k, b)
        o = self.attend(q, k, v, b)                                        # [rows, n_embd]
        if o is None:
            return None                                                    # only K/V were wanted
        x = b.keep(x)
        if a.residual_scale:
            o *= np.float32(a.residual_scale)
        x += o
        h = rms_norm(x, self.ffn_norm, a.rms_eps, b.buf("h", x.shape))
        d = ffn_swiglu(h, self.ffn_gate, self.ffn_up, self.ffn_down, b)
        if a.residual_scale:
            d *= np.float32(a.residual_scale)
        x += d
        return x


class Granite(Llama):
    """llama's tensors (Llama.TENSORS, LAYER_TENSORS) with GraniteBlock and the multipliers."""

    def build_blocks(self, layers):
        a = self.args
        self.check_biases(layers)
        rope = Rope(a.n_rot, a.rope_freq_base, a.rope_freq_scale, neox=False, freq_factors=self.rope_freqs,
                    attn_factor=a.rope_attn_factor) if a.rope else None
        return [GraniteBlock(w, a, il, rope) for il, w in enumerate(layers)]

    def embed(self, tokens):
        x = super().embed(tokens)
        if self.args.embedding_scale:
            x *= np.float32(self.args.embedding_scale)
        return x

    def logits(self, x):
        out = super().logits(x)
        out *= np.float32(1) / np.float32(self.args.logit_scale)
        return out


def load(gf: GGUFFile) -> Granite:
    """The model of a granite file. Raises GGUFError naming a bad key or tensor."""
    return Granite(gf, read_args(gf))
