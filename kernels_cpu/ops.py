"""Element-wise and attention kernels of the transformer forward pass.

Each kernel mirrors the ggml CPU operator named in its docstring; results agree with ggml up to
float summation order. All write into preallocated outputs (``out`` may alias the input where
noted) and take float32 C-contiguous arrays unless stated otherwise.
"""
import math

import numpy as np
from numba import njit, prange

from kernels_cpu.f16 import f16_to_f32, f32_to_f16

_SQRT_2_OVER_PI = np.float32(math.sqrt(2.0 / math.pi))
_GELU_COEF_A = np.float32(0.044715)


@njit(parallel=True, cache=True)
def rms_norm(x, weight, eps, out):
    """RMSNorm over the last axis, then scale by ``weight`` (ggml_rms_norm + ggml_mul).

    Shapes: x f32[T, n], weight f32[n], out f32[T, n] (may alias x). The sum of squares is
    accumulated in float64 as ggml does (ggml_float); scale = 1 / sqrt(mean + eps) in float32.
    """
    T, n = x.shape
    for t in prange(T):
        s = 0.0
        for i in range(n):
            v = np.float64(x[t, i])
            s += v * v
        scale = np.float32(1.0) / np.sqrt(np.float32(s / n) + np.float32(eps))
        for i in range(n):
            out[t, i] = (x[t, i] * scale) * weight[i]


@njit(parallel=True, cache=True)
def rms_norm_heads(x, weight, eps):
    """In-place RMSNorm of every head vector (Gemma 3's q/k norms, ggml_rms_norm on [hd, H, T]).

    Shapes: x f32[T, H, hd], weight f32[hd].
    """
    T, H, hd = x.shape
    for th in prange(T * H):
        t = th // H
        h = th % H
        s = 0.0
        for i in range(hd):
            v = np.float64(x[t, h, i])
            s += v * v
        scale = np.float32(1.0) / np.sqrt(np.float32(s / hd) + np.float32(eps))
        for i in range(hd):
            x[t, h, i] = (x[t, h, i] * scale) * weight[i]


def rope_cos_sin(positions, n_rot, freq_base, freq_scale=1.0, freq_factors=None):
    """cos/sin tables for RoPE (ggml_rope_ext without YaRN extrapolation).

    theta[t, i] = positions[t] * freq_scale * freq_base**(-2i/n_rot) / freq_factors[i],
    for i in [0, n_rot/2). Computed in float64, returned as float32[T, n_rot/2] each.
    ``freq_factors`` (llama 3's ``rope_freqs`` tensor) divides the frequencies, as in ggml.
    """
    inv = freq_base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, dtype=np.float64)
    theta = np.asarray(positions, dtype=np.float64)[:, None] * (freq_scale * inv)[None, :]
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


@njit(parallel=True, cache=True)
def rope(x, cos, sin, neox):
    """Rotary position embedding in place (ggml_rope_ext, modes NORM and NEOX).

    Shapes: x f32[T, H, hd], cos/sin f32[T, n_rot/2] with n_rot <= hd (the first n_rot
    dimensions rotate). NEOX pairs dimension i with i + n_rot/2 (GPT-NeoX, Qwen2, Gemma);
    NORM pairs 2i with 2i+1 (original LLaMA).
    """
    T, H, hd = x.shape
    half = cos.shape[1]
    for th in prange(T * H):
        t = th // H
        h = th % H
        for i in range(half):
            c = cos[t, i]
            s = sin[t, i]
            if neox:
                a = x[t, h, i]
                b = x[t, h, i + half]
                x[t, h, i] = a * c - b * s
                x[t, h, i + half] = a * s + b * c
            else:
                a = x[t, h, 2 * i]
                b = x[t, h, 2 * i + 1]
                x[t, h, 2 * i] = a * c - b * s
                x[t, h, 2 * i + 1] = a * s + b * c


@njit(parallel=True, cache=True)
def silu_mul(gate, up, out):
    """out = silu(gate) * up (ggml_swiglu / LLM_FFN_SILU + LLM_FFN_PAR). Shapes f32[T, n_ff]."""
    T, n = gate.shape
    for t in prange(T):
        for i in range(n):
            g = gate[t, i]
            out[t, i] = g / (np.float32(1.0) + np.exp(-g)) * up[t, i]


@njit(cache=True)
def _gelu_tanh(x):
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(_SQRT_2_OVER_PI * x * (np.float32(1.0) + _GELU_COEF_A * x * x)))


@njit(parallel=True, cache=True)
def gelu_mul(gate, up, out):
    """out = gelu(gate) * up with ggml's tanh-approximate GELU (ggml_geglu, LLM_FFN_GELU + PAR).

    Like ggml's CPU build (GGML_GELU_FP16), the GELU input is rounded to f16 and the result
    read back as f16 (ggml looks it up in a table of f16 values); x <= -10 gives 0 and x >= 10
    gives x. Shapes f32[T, n_ff].
    """
    T, n = gate.shape
    for t in prange(T):
        for i in range(n):
            g = gate[t, i]
            if g <= np.float32(-10.0):
                y = np.float32(0.0)
            elif g >= np.float32(10.0):
                y = g
            else:
                y = f16_to_f32(f32_to_f16(_gelu_tanh(f16_to_f32(f32_to_f16(g)))))
            out[t, i] = y * up[t, i]


@njit(cache=True)
def store_f16(src, dst):
    """dst (uint16 bits of f16) = src rounded to f16. Shapes: any equal 2-D shapes."""
    for i in range(src.shape[0]):
        for j in range(src.shape[1]):
            dst[i, j] = f32_to_f16(src[i, j])


@njit(parallel=True, cache=True, fastmath=True)
def attention_f16(q, k_cache, v_cache, positions, window, scale, out):
    """Causal multi-head attention with GQA over an f16 KV cache (softmax(q k^T * scale) v).

    Shapes: q f32[T, H, hd]; k_cache, v_cache uint16[n_ctx, H_kv, hd] (f16 bits, row j holds
    the key/value of position j); positions int32[T] (position of each query); out f32[T, H, hd].
    Query at position p attends to keys j <= p, and with ``window`` > 0 only to j > p - window
    (llama.cpp's LLAMA_SWA_TYPE_STANDARD). Softmax is computed online (running max and sum)
    in float32, so no scratch memory is needed.
    """
    T, H, hd = q.shape
    H_kv = k_cache.shape[1]
    group = H // H_kv
    for th in prange(T * H):
        t = th // H
        h = th % H
        kh = h // group
        p = positions[t]
        start = 0
        if window > 0 and p - window + 1 > 0:
            start = p - window + 1
        m = -np.inf
        l = np.float32(0.0)
        for i in range(hd):
            out[t, h, i] = 0.0
        for j in range(start, p + 1):
            s = np.float32(0.0)
            for i in range(hd):
                s += q[t, h, i] * f16_to_f32(k_cache[j, kh, i])
            s *= scale
            if s > m:
                corr = np.exp(m - s) if m > -np.inf else np.float32(0.0)
                l *= corr
                for i in range(hd):
                    out[t, h, i] *= corr
                m = s
            w = np.exp(s - m)
            l += w
            for i in range(hd):
                out[t, h, i] += w * f16_to_f32(v_cache[j, kh, i])
        inv = np.float32(1.0) / l
        for i in range(hd):
            out[t, h, i] *= inv
