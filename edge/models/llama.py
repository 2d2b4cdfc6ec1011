"""LLaMA (``general.architecture = llama``): RMSNorm, SwiGLU FFN, RoPE in the original
interleaved (NORM) pairing, optional QKV bias, optional llama-3 ``rope_freqs`` factors and
linear RoPE scaling, output tied to token_embd when ``output.weight`` is absent. Mirrors
llama.cpp's llm_build_llama.

The llama family as GGUF files carry it, all this architecture with other metadata: Llama 2
and 3.x (3.1+: llama3 RoPE scaling as the ``rope_freqs`` tensor), Mistral 7B and Mistral
Nemo / Small (attention.key_length 128 below n_embd / n_head), SmolLM2 (tied output),
DeepSeek-R1-Distill-Llama (rope_freqs), Falcon3 (head size 256). RoPE scaling types other
than none and linear (yarn, longrope) and mixture-of-experts files (Mixtral) are one-line
errors."""
from __future__ import annotations

import numpy as np
from gguf import Keys

from edge.gguf_file import GGUFError, GGUFFile
from edge.models.hparams import ModelArgs, read_int
from edge.models.layers import (ATTENTION_TENSORS, GATED_FFN_TENSORS, QKV_BIAS_TENSORS, Batch, Block, ffn_swiglu,
                                heads, optional_all, project_qkv, rms_norm)
from edge.models.rope import Rope, static_k_bias
from edge.models.transformer import EMBEDDING_AND_OUTPUT, Transformer
from edge.models.weights import optional

ARCH = "llama"


def read_args(gf: GGUFFile) -> ModelArgs:
    """The hyperparameters (edge.models.hparams: every key checked). Raises GGUFError, also for
    a mixture-of-experts file (expert_count > 0: Mixtral), which edge does not implement."""
    key = Keys.LLM.EXPERT_COUNT.format(arch=ARCH)
    n_expert = read_int(gf, key, default=0, lo=0)
    if n_expert:
        raise GGUFError(f"{gf.path}: {key} = {n_expert}: mixture-of-experts llama files are not supported")
    return ModelArgs.common_from_gguf(gf, ARCH, rope_neox=False)


class LlamaBlock(Block):
    """One layer of llm_build_llama (and llm_build_qwen2): attention (QKV bias when the file has
    it; RoPE as ``rope`` says) and a SwiGLU FFN, both pre-normed (RMSNorm) with residuals. A
    quantized K cache stores K without the static part of its bias (k_shift)."""

    def __init__(self, w: dict, a: ModelArgs, il: int, rope: Rope):
        super().__init__(w, a, il)
        self.rope = rope
        if self.attn_k_bias is not None:
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
        self.rope(q, b)
        self.rope(k, b)
        o = self.attend(q, k, v, b)                                        # [rows, n_embd]
        if o is None:
            return None                                                    # only K/V were wanted
        x = b.keep(x)
        x += o
        h = rms_norm(x, self.ffn_norm, a.rms_eps, b.buf("h", x.shape))
        x += ffn_swiglu(h, self.ffn_gate, self.ffn_up, self.ffn_down, b)
        return x


class Llama(Transformer):
    TENSORS = [*EMBEDDING_AND_OUTPUT, optional("rope_freqs.weight", "n_rot / 2")]
    LAYER_TENSORS = [*ATTENTION_TENSORS, *optional_all(QKV_BIAS_TENSORS), *GATED_FFN_TENSORS]  # biases: all or none

    def check_biases(self, layers: list[dict]) -> None:
        """Raise GGUFError naming a layer that has some but not all of the q, k and v biases."""
        for il, w in enumerate(layers):
            if len({w[n] is None for n in ("attn_q_bias", "attn_k_bias", "attn_v_bias")}) > 1:
                raise GGUFError(f"{self.gguf.path}: blk.{il}.attn_q/k/v.bias must be all present or all absent")

    def build_blocks(self, layers):
        a = self.args
        self.check_biases(layers)
        rope = Rope(a.n_rot, a.rope_freq_base, a.rope_freq_scale, neox=False, freq_factors=self.rope_freqs,
                    attn_factor=a.rope_attn_factor)
        return [LlamaBlock(w, a, il, rope) for il, w in enumerate(layers)]


def load(gf: GGUFFile) -> Llama:
    """The model of a llama file. Raises GGUFError naming a bad key or tensor."""
    return Llama(gf, read_args(gf))
