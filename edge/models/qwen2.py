"""Qwen2 (``general.architecture = qwen2``): LLaMA's blocks with QKV bias (required) and GPT-NeoX
RoPE pairing; the output tied to token_embd when ``output.weight`` is absent. Mirrors
llama.cpp's llm_build_qwen2, which is llm_build_llama's graph with the biases, so the block
is edge.models.llama's."""
from __future__ import annotations

from edge.gguf_file import GGUFFile
from edge.models.hparams import ModelArgs
from edge.models.layers import ATTENTION_TENSORS, GATED_FFN_TENSORS, QKV_BIAS_TENSORS
from edge.models.llama import LlamaBlock
from edge.models.rope import Rope
from edge.models.transformer import EMBEDDING_AND_OUTPUT, Transformer
from edge.models.weights import optional

ARCH = "qwen2"


def read_args(gf: GGUFFile) -> ModelArgs:
    """The hyperparameters (edge.models.hparams: every key checked). Raises GGUFError."""
    return ModelArgs.common_from_gguf(gf, ARCH, rope_neox=True)


class Qwen2(Transformer):
    TENSORS = [*EMBEDDING_AND_OUTPUT, optional("rope_freqs.weight", "n_rot / 2")]
    LAYER_TENSORS = [*ATTENTION_TENSORS, *QKV_BIAS_TENSORS, *GATED_FFN_TENSORS]

    def build_blocks(self, layers):
        a = self.args
        rope = Rope(a.n_rot, a.rope_freq_base, a.rope_freq_scale, neox=True, freq_factors=self.rope_freqs,
                    attn_factor=a.rope_attn_factor)
        return [LlamaBlock(w, a, il, rope) for il, w in enumerate(layers)]


def load(gf: GGUFFile) -> Qwen2:
    """The model of a qwen2 file. Raises GGUFError naming a bad key or tensor."""
    return Qwen2(gf, read_args(gf))
