"""numpy references for ggml's activation quantization (Q8_0, Q8_1, Q8_K): test oracles.

Vectorized restatements of the algorithms documented in kernels_cpu/quantize_act.py
(ggml-cpu/arch/x86/quants.c quantize_row_q8_0 / quantize_row_q8_1, ggml-quants.c
quantize_row_q8_K_ref), written independently of the numba kernels so each checks the other.
All arithmetic is float32; rounding is ties-to-even (np.rint) as in the x86 build.

Shapes: x float32[T, K] -> qs int8[T, K], d float32[T, K/32 or K/256] (f16-rounded for Q8_0 and
Q8_1), s float32[T, K/32] (Q8_1), bsums int16[T, K/16] (Q8_K).
"""
from __future__ import annotations

import numpy as np


def _f16_round(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # beyond f16 max -> inf, as in ggml
        return v.astype(np.float16).astype(np.float32)


def quantize_q8_0_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 as ggml's x86 quantize_row_q8_0: d = f16(amax / 127), q = rint(x * (127 / amax))."""
    T, K = x.shape
    blocks = x.astype(np.float32).reshape(T, K // 32, 32)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    qs = np.rint(blocks * inv[..., None]).astype(np.int8).reshape(T, K)
    return qs, _f16_round(amax / np.float32(127))


def quantize_q8_1_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q8_1 as ggml's x86 quantize_row_q8_1: Q8_0 plus s = f16((amax / 127) * sum(q))."""
    qs, d = quantize_q8_0_ref(x)
    T, K = x.shape
    amax = np.abs(x.astype(np.float32).reshape(T, K // 32, 32)).max(axis=-1)
    sums = qs.reshape(T, K // 32, 32).astype(np.int32).sum(axis=-1).astype(np.float32)
    return qs, d, _f16_round((amax / np.float32(127)) * sums)


def quantize_q8_k_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q8_K as ggml's quantize_row_q8_K_ref: iscale = -127 / max (signed), q = min(127, rint(iscale*x))."""
    T, K = x.shape
    blocks = x.astype(np.float32).reshape(T, K // 256, 256)
    first_max = np.abs(blocks).argmax(axis=-1)[..., None]
    vmax = np.take_along_axis(blocks, first_max, axis=-1)[..., 0]
    zero = vmax == 0
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, np.float32(0), np.float32(-127) / np.where(zero, np.float32(1), vmax))
        iscale = iscale.astype(np.float32)
        d = np.where(zero, np.float32(0), np.float32(1) / np.where(zero, np.float32(1), iscale)).astype(np.float32)
    q = np.minimum(np.rint(blocks * iscale[..., None]), 127).astype(np.int8)
    bsums = q.reshape(T, K // 16, 16).astype(np.int32).sum(axis=-1).astype(np.int16)
    return q.reshape(T, K), d, bsums
