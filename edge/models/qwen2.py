"""Qwen2 (``general.architecture = qwen2``): LLaMA-like blocks with QKV bias and GPT-NeoX
RoPE pairing. Mirrors llama.cpp's llm_build_qwen2."""
from edge.gguf_file import GGUFFile
from edge.models.common import Transformer
from edge.models.hparams import ModelArgs


def load(gf: GGUFFile) -> Transformer:
    args = ModelArgs.common_from_gguf(gf, "qwen2", rope_neox=True, qkv_bias=True)
    return Transformer(gf, args)
