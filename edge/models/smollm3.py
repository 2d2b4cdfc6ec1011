"""SmolLM3 (``general.architecture = smollm3``). Mirrors llama.cpp's smollm3 graph
(llm_build_smollm3; in llama.cpp 0.3.36 ``llama_model_smollm3::graph``,
src/models/smollm3.cpp): LLaMA's layer (edge.models.llama.LlamaBlock: RMSNorm, q/k/v without
biases, SwiGLU FFN, RoPE in the NORM pairing over the whole head, softmax scale
1/sqrt(head_dim)), except that every 4th layer (il + 1 divisible by 4) applies no RoPE: llama.cpp
sets n_no_rope_layer_step = 4 for smollm3 itself, the file has no key for it. Output tied to
token_embd when ``output.weight`` is absent.
"""
from __future__ import annotations

from edge.gguf_file import GGUFFile
from edge.models.hparams import ModelArgs
from edge.models.layers import ATTENTION_TENSORS, GATED_FFN_TENSORS
from edge.models.llama import LlamaBlock
from edge.models.rope import NoRope, Rope
from edge.models.transformer import EMBEDDING_AND_OUTPUT, Transformer

ARCH = "smollm3"
NO_ROPE_LAYER_STEP = 4   # llama.cpp: hparams.n_no_rope_layer_step = 4 in llama_model_smollm3::load_arch_hparams


def read_args(gf: GGUFFile) -> ModelArgs:
    """The hyperparameters (edge.models.hparams: every key checked). Raises GGUFError."""
    return ModelArgs.common_from_gguf(gf, ARCH, rope_neox=False)


def uses_rope(il: int) -> bool:
    """Whether layer il rotates q and k (llama.cpp: (il + 1) % n_no_rope_layer_step != 0)."""
    return (il + 1) % NO_ROPE_LAYER_STEP != 0


class SmolLM3(Transformer):
    TENSORS = EMBEDDING_AND_OUTPUT
    LAYER_TENSORS = [*ATTENTION_TENSORS, *GATED_FFN_TENSORS]

    def build_blocks(self, layers):
        a = self.args
        rope = Rope(a.n_rot, a.rope_freq_base, a.rope_freq_scale, neox=False)
        no_bias = dict(attn_q_bias=None, attn_k_bias=None, attn_v_bias=None)    # smollm3 files have none
        return [LlamaBlock({**w, **no_bias}, a, il, rope if uses_rope(il) else NoRope()) for il, w in enumerate(layers)]


def load(gf: GGUFFile) -> SmolLM3:
    """The model of a smollm3 file. Raises GGUFError naming a bad key or tensor."""
    return SmolLM3(gf, read_args(gf))
