"""The tiny random-weight models edge is compared with llama.cpp on, one per architecture and
weight type (tests/test_arch_llama_cpp.py; fixtures made by tools/make_arch_fixtures.py).

ARCH_CASES maps a case name ``<arch>-<weights>`` to the keyword arguments of
tests.tiny_models.write_tiny_model. Each architecture has three cases: ``f16`` (every matrix
F16), ``q8_0`` (every matrix Q8_0) and ``q4_k`` (a Q4_K_M-like mix of Q4_K, Q5_K and Q6_K).
Norms, biases and the MoE router (ffn_gate_inp) stay F32 in all three, as llama.cpp's converter
and llama-quantize leave them. Sizes are the smallest that K-quants take (rows of 256 values)
with a few heads and GQA; a case that changes makes another file, whose sha256 no longer
matches its fixture: rebuild it with ``tools/make_arch_fixtures.py CASE``.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType as Q

# every matrix role of tests.tiny_models.write_tiny_model but the router (F32, as in real files)
MATRIX_ROLES = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                "ffn_down", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")

WEIGHT_TYPES = {
    "f16": {r: Q.F16 for r in MATRIX_ROLES},
    "q8_0": {r: Q.Q8_0 for r in MATRIX_ROLES},
    # like llama-quantize's Q4_K_M: Q4_K most, Q6_K for attn_v / ffn_down / output; Q5_K for
    # attn_output so that the three K-quant kernels all run
    "q4_k": {"token_embd": Q.Q4_K, "output": Q.Q6_K, "attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K,
             "attn_output": Q.Q5_K, "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K,
             "ffn_gate_exps": Q.Q4_K, "ffn_up_exps": Q.Q4_K, "ffn_down_exps": Q.Q6_K},
}

# per architecture: the write_tiny_model arguments shared by its three weight types
ARCHS = {
    # head_dim 128 with 4 heads: q is wider than n_embd, as in the real Qwen3 models
    "qwen3": dict(arch="qwen3", n_embd=256, n_head=4, n_head_kv=2, head_dim=128, n_ff=512, n_layer=2),
    # 8 experts, 2 used per token, experts of 256 (rows of 256 for the K-quants' ffn_down_exps)
    "qwen3moe": dict(arch="qwen3moe", n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_layer=2,
                     n_expert=8, n_expert_used=2, n_ff_exp=256),
    "olmo2": dict(arch="olmo2", n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_layer=2),
    # 4 layers: the 4th has no RoPE
    "smollm3": dict(arch="smollm3", n_embd=256, n_head=4, n_head_kv=1, n_ff=512, n_layer=4),
    # LongRoPE past the original context (64 < llama.cpp's n_ctx 64 padded to 256): the long
    # factors and the attention factor; 48 of 64 head dimensions turned (Phi-4-mini's 3/4)
    "phi3": dict(arch="phi3", n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_layer=2, rope_dims=48,
                 rope_factors=True,
                 metadata={".rope.scaling.original_context_length": 64, ".rope.scaling.attn_factor": 1.19}),
    # soft caps low enough to bite on random weights; a window of 4 tokens on layers 0 and 2
    "gemma2": dict(arch="gemma2", n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_layer=4,
                   sliding_window=4, metadata={".attn_logit_softcapping": 4.0, ".final_logit_softcapping": 10.0}),
    # Granite 3's embedding, residual, attention and logit multipliers (tests.tiny_models)
    "granite": dict(arch="granite", n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_layer=2),
    # the llama family: Llama 3.x / DeepSeek-R1-Distill-Llama (llama3 RoPE scaling as rope_freqs) ...
    "llama3": dict(arch="llama", n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_layer=2, rope_freqs=True),
    # ... Mistral Nemo / Small (key_length 128 over n_embd / n_head = 64) with SmolLM2's tied output
    "mistral": dict(arch="llama", n_embd=256, n_head=4, n_head_kv=1, head_dim=128, n_ff=512, n_layer=2,
                    tie_output=True),
}

ARCH_CASES = {f"{name}-{wt}": dict(kw, types=types) for name, kw in ARCHS.items() for wt, types in WEIGHT_TYPES.items()}
# and single cases of a variant: OLMo 3's sliding window (layers 0-2 local with a window of 4
# tokens, layer 3 global) under linear RoPE scaling, which olmo2's local layers do not apply
ARCH_CASES["olmo2-swa-f16"] = dict(ARCHS["olmo2"], n_layer=4, sliding_window=4, rope_scaling_factor=2.0,
                                   types=WEIGHT_TYPES["f16"])
# phi3 within its original context (256 = llama.cpp's padded n_ctx): the short factors
ARCH_CASES["phi3short-q8_0"] = dict(ARCHS["phi3"], rope_dims=None, metadata={".rope.scaling.attn_factor": 1.19},
                                    types=WEIGHT_TYPES["q8_0"])
