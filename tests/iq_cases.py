"""The tiny random-weight models that hold edge's I-quant, ternary and MXFP4 kernels to llama.cpp
(tests/test_iq_models.py; made by tools/make_iq_fixtures.py).

One architecture (llama3: Llama 3's RoPE factors as rope_freqs), one layer, n_embd and n_ff 256
so that every matrix row is a whole number of 256-value super-blocks. The F16 model BASE is
written by tests.tiny_models.write_tiny_model with a vocabulary of single characters (TOKENS) so
that llama-imatrix can tokenize a text for it (IMATRIX_TEXT). Each case of IQ_CASES is
llama-quantize's output for that F16 file:

    llama-quantize --imatrix imatrix.gguf --token-embedding-type q8_0 --output-tensor-type <T> \
                   --tensor-type <role>=<T> ... f16.gguf <case>.gguf <T>

with every attention and FFN matrix and the output in the type under test (token_embd in Q8_0:
the imatrix has no row data for a get_rows tensor and the low-bit types refuse to quantize
without it). The quantized GGUFs are committed (tests/data/arch/iq/<case>.gguf, a few hundred KB
at most): rebuilding them needs llama-quantize, and the fixture's gguf_sha256 names the file.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

# SentencePiece's word boundary and the 94 printable ASCII characters but space, then <unk> (id
# 95); llama.cpp's SPM tokenizer turns any such text into one token per character
TOKENS = ["\u2581"] + [chr(c) for c in range(33, 127)] + ["<unk>"]
assert len(TOKENS) == 96

BASE = {"arch": "llama", "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 256, "n_layer": 1, "rope_freqs": True,
        "tokens": TOKENS, "types": {r: Q.F16 for r in ("token_embd", "output", "attn_q", "attn_k", "attn_v",
                                                       "attn_output", "ffn_gate", "ffn_up", "ffn_down")}}

# the layer matrices quantized to the type under test (llama-quantize's --tensor-type names)
QUANT_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def imatrix_text(n_words: int = 400, seed: int = 7) -> str:
    """The deterministic text llama-imatrix runs the F16 model over: seeded random words of
    TOKENS' characters (about 2600 tokens, 40 chunks of 64)."""
    rng = np.random.default_rng(seed)
    chars = np.array(TOKENS[1:-1])
    return " ".join("".join(rng.choice(chars, rng.integers(2, 10))) for _ in range(n_words)) + "\n"


# case name -> the ggml type of its quantized matrices (llama-quantize's name), in priority order
IQ_CASES = {f"llama3-{t.lower()}": t for t in ("IQ4_XS", "IQ4_NL", "IQ3_S", "IQ2_XXS", "TQ2_0", "IQ1_S",
                                              "IQ3_XXS", "IQ2_XS", "IQ2_S", "IQ1_M", "TQ1_0", "MXFP4")}
