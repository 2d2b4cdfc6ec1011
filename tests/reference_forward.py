"""A plain numpy reference forward pass for llama, qwen2 and gemma3 GGUF files.

Independent of edge's model code and kernels: it reads the file with gguf.GGUFReader,
dequantizes every weight with gguf.quants, and runs the whole sequence in float64 with no
KV cache (keys and values rounded to f16, as llama.cpp's cache stores them) and a dense
causal (and sliding-window) mask. Before each matmul the activations are
rounded the way llama.cpp's CPU backend quantizes them for that weight type (quant/activations.py
numpy references: Q8_0, Q8_1, Q8_K; f16/bf16 for F16/BF16 weights), so what remains between
this reference and edge is float summation order and the f16 KV cache. It follows llama.cpp's
graph builders (llm_build_llama / qwen2 / gemma3_iswa) as documented in their source.
"""
from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType as Q, GGUFReader
from gguf.quants import dequantize

from quant.activations import quantize_q8_0_ref, quantize_q8_1_ref, quantize_q8_k_ref

_VEC_DOT_Q8_0 = {Q.Q4_0, Q.Q5_0, Q.Q8_0}
_VEC_DOT_Q8_1 = {Q.Q4_1, Q.Q5_1}
_VEC_DOT_Q8_K = {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}


def _as_matmul_input(x: np.ndarray, qtype) -> np.ndarray:
    """x f64[T, K] rounded as llama.cpp rounds a matmul input for weights of ``qtype``."""
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    T, K = x32.shape
    if qtype in _VEC_DOT_Q8_0 or qtype in _VEC_DOT_Q8_1:
        qs, d = (quantize_q8_0_ref if qtype in _VEC_DOT_Q8_0 else quantize_q8_1_ref)(x32)[:2]
        return (qs.reshape(T, -1, 32).astype(np.float64) * d[..., None]).reshape(T, K)
    if qtype in _VEC_DOT_Q8_K:
        qs, d, _ = quantize_q8_k_ref(x32)
        return (qs.reshape(T, -1, 256).astype(np.float64) * d[..., None]).reshape(T, K)
    if qtype == Q.F16:
        return x32.astype(np.float16).astype(np.float64)
    if qtype == Q.BF16:
        return (x32.view(np.uint32) + 0x7FFF + ((x32.view(np.uint32) >> 16) & 1) >> 16 << 16).view(np.float32).astype(np.float64)
    return x32.astype(np.float64)


def _weights(path):
    r = GGUFReader(path)
    meta = {}
    for k, f in r.fields.items():
        try:
            meta[k] = f.contents()
        except Exception:  # pragma: no cover - exotic types unused here
            pass
    w, types = {}, {}
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order
        w[t.name] = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64).reshape(shape)
        types[t.name] = t.tensor_type
    return meta, w, types


def _f16(x):
    return x.astype(np.float32).astype(np.float16).astype(np.float64)


def _rms(x, weight, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def _rope(x, pos, base, neox, freq_scale=1.0, factors=None):
    """x [T, H, d]."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2) / d)
    if factors is not None:
        inv = inv / factors
    th = pos[:, None] * freq_scale * inv[None, :]          # [T, d/2]
    c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., : d // 2], x[..., d // 2 :]
        out[..., : d // 2], out[..., d // 2 :] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


def _gelu(x):
    """tanh-approximate GELU."""
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def reference_logits(path, tokens) -> np.ndarray:
    """Logits float64[T, n_vocab] for every position of ``tokens`` (positions 0..T-1)."""
    meta, w, types = _weights(path)

    def mm(x, name):
        return _as_matmul_input(x, types[name]) @ w[name].T
    arch = meta["general.architecture"]
    k = arch + "."
    n_head = meta[k + "attention.head_count"]
    n_kv = meta.get(k + "attention.head_count_kv", n_head)
    n_embd = meta[k + "embedding_length"]
    hd = meta.get(k + "attention.key_length", n_embd // n_head)
    eps = meta[k + "attention.layer_norm_rms_epsilon"]
    base = meta.get(k + "rope.freq_base", 10000.0)
    freq_scale = 1.0
    if meta.get(k + "rope.scaling.type") == "linear":
        freq_scale = 1.0 / meta[k + "rope.scaling.factor"]
    factors = w.get("rope_freqs.weight")
    gemma = arch == "gemma3"
    neox = arch != "llama"
    window = meta.get(k + "attention.sliding_window", 0) if gemma else 0
    T = len(tokens)
    pos = np.arange(T, dtype=np.float64)
    x = w["token_embd.weight"][np.asarray(tokens)]
    if gemma:
        x = x * math.sqrt(n_embd)
    causal = np.tril(np.ones((T, T), dtype=bool))
    for il in range(meta[k + "block_count"]):
        p = f"blk.{il}."
        swa = gemma and window > 0 and il % 6 < 5
        h = _rms(x, w[p + "attn_norm.weight"], eps)
        q = mm(h, p + "attn_q.weight")
        kk = mm(h, p + "attn_k.weight")
        v = mm(h, p + "attn_v.weight")
        if p + "attn_q.bias" in w:
            q, kk, v = q + w[p + "attn_q.bias"], kk + w[p + "attn_k.bias"], v + w[p + "attn_v.bias"]
        q, kk, v = q.reshape(T, n_head, hd), kk.reshape(T, n_kv, hd), v.reshape(T, n_kv, -1)
        if gemma:
            q = _rms(q, w[p + "attn_q_norm.weight"], eps)
            kk = _rms(kk, w[p + "attn_k_norm.weight"], eps)
        b = 10000.0 if swa else base
        fs = 1.0 if swa else freq_scale
        q, kk = _rope(q, pos, b, neox, fs, factors), _rope(kk, pos, b, neox, fs, factors)
        kk, v = _f16(kk), _f16(v)  # llama.cpp's default KV cache type is f16
        mask = causal.copy()
        if swa:
            mask &= (pos[:, None] - pos[None, :]) < window
        g = n_head // n_kv
        out = np.empty((T, n_head, v.shape[-1]))
        for hh in range(n_head):
            s = q[:, hh] @ kk[:, hh // g].T / math.sqrt(hd)
            s = np.where(mask, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, hh // g]
        o = mm(out.reshape(T, -1), p + "attn_output.weight")
        if gemma:
            o = _rms(o, w[p + "post_attention_norm.weight"], eps)
        x = x + o
        h = _rms(x, w[p + "ffn_norm.weight"], eps)
        gate, up = mm(h, p + "ffn_gate.weight"), mm(h, p + "ffn_up.weight")
        act = _gelu(gate) if gemma else gate / (1 + np.exp(-gate))
        d = mm(act * up, p + "ffn_down.weight")
        if gemma:
            d = _rms(d, w[p + "post_ffw_norm.weight"], eps)
        x = x + d
    x = _rms(x, w["output_norm.weight"], eps)
    return mm(x, "output.weight" if "output.weight" in w else "token_embd.weight")
