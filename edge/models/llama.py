"""LLaMA (``general.architecture = llama``): RMSNorm, SwiGLU FFN, RoPE in the original
interleaved (NORM) pairing, optional QKV bias, optional llama-3 ``rope_freqs`` factors and
linear RoPE scaling, output tied to token_embd when ``output.weight`` is absent.
Mirrors llama.cpp's llm_build_llama."""
from edge.gguf_file import GGUFFile
from edge.models.common import Transformer
from edge.models.hparams import ModelArgs


def load(gf: GGUFFile) -> Transformer:
    args = ModelArgs.common_from_gguf(gf, "llama", rope_neox=False, qkv_bias=None)
    return Transformer(gf, args)
