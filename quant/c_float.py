"""C's float arithmetic as ggml-quants.c compiles it, for the quantizers of quant/ (numba helpers).

ggml-quants.c is compiled in llama.cpp's build for baseline x86-64 (SSE2, no FMA), so every C
float expression is evaluated in float32, one rounded operation at a time, left to right; the
quantizers write each operation in the same order, and numba (no fastmath) neither contracts nor
reorders float arithmetic. The details the bytes depend on:

* ``nearest_int`` (kernels_cpu.quantize_act) is ggml's bit trick (add 1.5 * 2**23, keep the
  mantissa): ties to even, and it wraps instead of saturating for |v| >= 2**22, as in C (the
  K-quants clamp after it).
* C's float -> int8_t / uint8_t casts compile to cvttss2si / cvttps2dq: truncation toward zero;
  NaN, Inf and |v| >= 2**31 give 0x80000000, whose low byte is 0 (``c_byte``).
* Stores into uint8_t / int8_t fields wrap; MIN / MAX are C's ternaries, so a NaN operand is
  picked exactly as in C.
* fp16 fields round to nearest even (overflow -> Inf, subnormals kept); NaN -> 0x7E00 | sign as
  ggml_compute_fp32_to_fp16. The K-quants re-quantize with the fp16-rounded scales, and a
  sub-block whose rounded scale is 0 keeps the quants of the scale search.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from kernels_cpu.f16 import f16_to_f32, f32_to_f16
from kernels_cpu.simd import bits_from_f32

ZERO = np.float32(0.0)
HALF = np.float32(0.5)
ONE = np.float32(1.0)
FLT_MAX = np.float32(np.finfo(np.float32).max)
TWO_POW_23 = np.float32(2.0**23)
TWO_POW_31 = np.float32(2.0**31)
GROUP_MAX_EPS = np.float32(1e-15)  # ggml-quants.c GROUP_MAX_EPS


@njit(cache=True, error_model="numpy", inline="always")
def c_byte(v):
    """Low byte (0..255) of C's float32 -> int8_t/uint8_t cast on x86-64: truncation toward
    zero; NaN, Inf and |v| >= 2**31 convert to 0x80000000, whose low byte is 0."""
    if abs(v) < TWO_POW_31:  # False for NaN
        return np.int64(np.int32(v)) & 0xFF
    return 0


@njit(cache=True, error_model="numpy", inline="always")
def load_byte(buf, i):
    """buf[i] of a uint8 array as int64 (keeps numba's integer arithmetic signed)."""
    return np.int64(buf[i])


@njit(cache=True, error_model="numpy", inline="always")
def as_int8(byte):
    """Byte 0..255 -> the int8_t it holds (-128..127)."""
    return ((byte + 128) & 0xFF) - 128


@njit(cache=True, error_model="numpy", inline="always")
def roundf(v):
    """C ``roundf`` on float32: nearest integer, halves away from zero; NaN and Inf unchanged."""
    if not abs(v) < TWO_POW_23:  # already integral, or NaN / Inf
        return v
    t = np.float32(np.int32(v))
    if abs(v - t) >= HALF:  # v - t is exact
        t = t + (ONE if v > ZERO else -ONE)
    return t


@njit(cache=True, error_model="numpy", inline="always")
def fp16_bits(v):
    """ggml_compute_fp32_to_fp16: binary16 bits of float32 ``v`` (RNE), NaN -> 0x7E00 | sign."""
    if v != v:
        return np.int64(0x7E00) | ((np.int64(bits_from_f32(v)) >> 16) & 0x8000)
    return np.int64(f32_to_f16(v))


@njit(cache=True, error_model="numpy", inline="always")
def put_fp16(out, o, v):
    """Store fp16(v) little-endian at out[o:o+2]; return its value as float32
    (GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v)), what the K-quants re-quantize with)."""
    h = fp16_bits(v)
    out[o] = h & 0xFF
    out[o + 1] = h >> 8
    return f16_to_f32(h)


@njit(cache=True, error_model="numpy", inline="always")
def bf16_bits(v):
    """ggml_compute_fp32_to_bf16: round to nearest even on the bits; NaN -> (u >> 16) | 64."""
    u = np.int64(bits_from_f32(v))
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return (u >> 16) | 64
    return (u + (0x7FFF + ((u >> 16) & 1))) >> 16
