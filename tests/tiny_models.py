"""Tiny random-weight GGUF files for the architectures edge implements, written with gguf's
GGUFWriter. Used to test the model code against tests/reference_forward.py, and (the cases of
tests/arch_cases.py) against llama.cpp itself: each architecture's file holds the metadata keys
and tensors llama.cpp 0.3.36 loads it with (src/models/<arch>.cpp), and a vocabulary it accepts.

Per architecture, the tensors of a layer beyond attention (attn_q/k/v/output):
  llama, smollm3: attn_norm, ffn_norm, ffn_gate/up/down (smollm3: no RoPE in every 4th layer)
  qwen2:          + attn_q/k/v.bias
  gemma3:         + attn_q_norm, attn_k_norm (per head), post_attention_norm, post_ffw_norm
  qwen3:          + attn_q_norm, attn_k_norm (per head)
  qwen3moe:       qwen3's attention; ffn_gate_inp [n_expert, n_embd] and the experts
                  ffn_gate_exps / ffn_up_exps [n_expert, n_ff_exp, n_embd], ffn_down_exps
                  [n_expert, n_embd, n_ff_exp] instead of ffn_gate/up/down
  olmo2:          no attn_norm / ffn_norm; attn_q_norm [n_head * head_dim], attn_k_norm
                  [n_head_kv * head_dim] (over the whole projection), post_attention_norm,
                  post_ffw_norm
  gemma2:         + post_attention_norm, post_ffw_norm; output tied
  phi3:           attn_qkv [(n_head + 2 n_head_kv) * head_dim, n_embd] (role attn_q unless
                  types names attn_qkv) for attn_q/k/v; ffn_up [2 n_ff, n_embd] (gate | up),
                  no ffn_gate; rope_factors_long / _short with rope_factors
  granite:        llama's; the four multipliers in the metadata
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q, GGUFWriter
from gguf.quants import quantize

from kernels_cpu.ggml_types import TYPES

# K-quant blocks: byte offsets of the f16 super-block scales (d, and dmin where present)
_K_SCALE_OFFSETS = {t: TYPES[t].f16_scales for t in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)}
# super-block scales that give weights of order 0.3, like real models (max |w| ~ d * 63 * 15 for Q4_K)
_K_SCALE = {Q.Q2_K: 0.02, Q.Q3_K: 0.008, Q.Q4_K: 0.001, Q.Q5_K: 0.0005, Q.Q6_K: 0.0002}


def random_tensor(rng, shape, qtype, scale=0.3):
    """Random weights of numpy shape ``shape`` stored as ``qtype`` (array to hand GGUFWriter)."""
    if qtype in _K_SCALE_OFFSETS:
        block, size = TYPES[qtype].block_size, TYPES[qtype].type_size
        n_blocks = shape[-1] // block
        raw = rng.integers(0, 256, size=(*shape[:-1], n_blocks, size), dtype=np.uint8)
        for off in _K_SCALE_OFFSETS[qtype]:
            d = (rng.uniform(0.5, 1.5, size=raw.shape[:-1]) * _K_SCALE[qtype]).astype(np.float16)
            raw[..., off : off + 2] = d.view(np.uint8).reshape(*d.shape, 2)
        return raw.reshape(*shape[:-1], n_blocks * size)
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    if qtype == Q.F32:
        return x
    if qtype == Q.F16:
        return x.astype(np.float16)
    return quantize(x, qtype)


# Granite 3's multipliers (granite-3.x-2b: embedding 12, residual 0.22, attention 1/128, logits 8)
GRANITE_SCALES = {".embedding_scale": 12.0, ".residual_scale": 0.22, ".attention.scale": 0.0078125,
                  ".logit_scale": 8.0}


def write_tiny_model(path, arch="llama", types=None, seed=0, n_embd=64, n_head=4, n_head_kv=2,
                     head_dim=None, n_ff=128, n_layer=2, n_vocab=96, sliding_window=0,
                     rope_scaling_factor=0.0, rope_freqs=False, tie_output=False, extra_tensors=(),
                     n_tokens=None, rope_dims=None, swa_pattern=None, n_expert=4, n_expert_used=2,
                     n_ff_exp=None, metadata=None, rope_factors=False, tokens=None):
    """Write a tiny ``arch`` model with random weights to ``path``.

    ``types`` maps a tensor role ('attn_q', 'ffn_down', 'token_embd', 'output', 'ffn_gate_exps',
    'ffn_gate_inp', ...) to a GGMLQuantizationType (default F32 everywhere). ``rope_dims`` and
    ``swa_pattern``, when given, are written as rope.dimension_count and
    attention.sliding_window_pattern (absent otherwise: the loaders' defaults). ``n_expert``,
    ``n_expert_used`` and ``n_ff_exp`` (default n_ff) size a qwen3moe file's experts.
    ``metadata`` adds keys ({key: value}, ``{arch}.`` prefixed when the key starts with ".";
    float32, uint32, bool or string by the value's type; a granite file has Granite 3's
    multipliers unless it sets them); ``rope_factors`` writes LongRoPE's rope_factors_long /
    rope_factors_short (phi3); ``tokens`` (list of str) replaces the vocabulary ``<t0>``, ``<t1>``,
    ... (a text llama.cpp can tokenize, tests/iq_cases.py). The same arguments write the same bytes (seeded). Returns the path.
    """
    types = types or {}
    rng = np.random.default_rng(seed)
    hd = head_dim or n_embd // n_head
    w = GGUFWriter(str(path), arch)
    k = arch + "."
    w.add_uint32(k + "context_length", 256)
    w.add_uint32(k + "embedding_length", n_embd)
    w.add_uint32(k + "block_count", n_layer)
    w.add_uint32(k + "feed_forward_length", n_ff)
    w.add_uint32(k + "attention.head_count", n_head)
    w.add_uint32(k + "attention.head_count_kv", n_head_kv)
    w.add_float32(k + "attention.layer_norm_rms_epsilon", 1e-6)
    moe = arch == "qwen3moe"
    n_ff_exp = n_ff_exp or n_ff
    if moe:
        w.add_uint32(k + "expert_count", n_expert)
        w.add_uint32(k + "expert_used_count", n_expert_used)
        w.add_uint32(k + "expert_feed_forward_length", n_ff_exp)
    w.add_float32(k + "rope.freq_base", 10000.0 if arch == "llama" else 1e6)
    if head_dim:
        w.add_uint32(k + "attention.key_length", hd)
        w.add_uint32(k + "attention.value_length", hd)
    if sliding_window:
        w.add_uint32(k + "attention.sliding_window", sliding_window)
    if rope_dims is not None:
        w.add_uint32(k + "rope.dimension_count", rope_dims)
    if swa_pattern is not None:
        w.add_uint32(k + "attention.sliding_window_pattern", swa_pattern)
    if rope_scaling_factor:
        w.add_string(k + "rope.scaling.type", "linear")
        w.add_float32(k + "rope.scaling.factor", rope_scaling_factor)
    meta = dict(GRANITE_SCALES) if arch == "granite" else {}
    meta.update(metadata or {})
    for key, value in meta.items():
        key = arch + key if key.startswith(".") else key
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, value)
    n_tok = n_vocab if n_tokens is None else n_tokens
    w.add_tokenizer_model("llama")
    w.add_token_list(list(tokens) if tokens is not None else [f"<t{i}>" for i in range(n_tok)])
    w.add_token_scores([0.0] * n_tok)
    w.add_token_types([1] * n_tok)

    def add(name, shape, role, scale=0.3):
        w.add_tensor(name, random_tensor(rng, shape, types.get(role, Q.F32), scale), raw_dtype=types.get(role, Q.F32))

    def norm(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    add("token_embd.weight", (n_vocab, n_embd), "token_embd", 1.0)
    for il in range(n_layer):
        p = f"blk.{il}."
        if arch != "olmo2":
            norm(p + "attn_norm.weight", n_embd)
        if arch == "phi3":
            role = "attn_qkv" if "attn_qkv" in types else "attn_q"
            add(p + "attn_qkv.weight", ((n_head + 2 * n_head_kv) * hd, n_embd), role)
        else:
            add(p + "attn_q.weight", (n_head * hd, n_embd), "attn_q")
            add(p + "attn_k.weight", (n_head_kv * hd, n_embd), "attn_k")
            add(p + "attn_v.weight", (n_head_kv * hd, n_embd), "attn_v")
        add(p + "attn_output.weight", (n_embd, n_head * hd), "attn_output")
        if arch == "qwen2":
            for t, n in (("q", n_head * hd), ("k", n_head_kv * hd), ("v", n_head_kv * hd)):
                w.add_tensor(f"{p}attn_{t}.bias", (0.1 * rng.standard_normal(n)).astype(np.float32))
        if arch == "gemma3":
            norm(p + "attn_q_norm.weight", hd)
            norm(p + "attn_k_norm.weight", hd)
        if arch in ("gemma3", "gemma2"):
            norm(p + "post_attention_norm.weight", n_embd)
            norm(p + "post_ffw_norm.weight", n_embd)
        if arch in ("qwen3", "qwen3moe"):
            norm(p + "attn_q_norm.weight", hd)
            norm(p + "attn_k_norm.weight", hd)
        if arch == "olmo2":
            norm(p + "attn_q_norm.weight", n_head * hd)
            norm(p + "attn_k_norm.weight", n_head_kv * hd)
            norm(p + "post_attention_norm.weight", n_embd)
        else:
            norm(p + "ffn_norm.weight", n_embd)
        if moe:
            add(p + "ffn_gate_inp.weight", (n_expert, n_embd), "ffn_gate_inp")
            add(p + "ffn_gate_exps.weight", (n_expert, n_ff_exp, n_embd), "ffn_gate_exps")
            add(p + "ffn_up_exps.weight", (n_expert, n_ff_exp, n_embd), "ffn_up_exps")
            add(p + "ffn_down_exps.weight", (n_expert, n_embd, n_ff_exp), "ffn_down_exps")
            continue
        if arch == "phi3":
            add(p + "ffn_up.weight", (2 * n_ff, n_embd), "ffn_up")
        else:
            add(p + "ffn_gate.weight", (n_ff, n_embd), "ffn_gate")
            add(p + "ffn_up.weight", (n_ff, n_embd), "ffn_up")
        add(p + "ffn_down.weight", (n_embd, n_ff), "ffn_down")
        if arch == "olmo2":
            norm(p + "post_ffw_norm.weight", n_embd)
    norm("output_norm.weight", n_embd)
    if not tie_output and arch not in ("gemma3", "gemma2"):
        add("output.weight", (n_vocab, n_embd), "output")
    if rope_factors:
        n_pairs = (rope_dims or hd) // 2
        w.add_tensor("rope_factors_long.weight", rng.uniform(1.0, 8.0, n_pairs).astype(np.float32))
        w.add_tensor("rope_factors_short.weight", rng.uniform(0.8, 1.5, n_pairs).astype(np.float32))
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", rng.uniform(1.0, 8.0, hd // 2).astype(np.float32))
    for name in extra_tensors:
        w.add_tensor(name, np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
