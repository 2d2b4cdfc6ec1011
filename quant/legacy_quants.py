"""ggml's quantizers without an imatrix for the float types and the 32-value blocks: F16, BF16,
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (ggml_fp32_to_fp16_row, ggml_fp32_to_bf16_row_ref,
quantize_row_<type>_ref), byte for byte (C's float arithmetic: quant.c_float).

A kernel ``quantize_<type>(x, out)`` quantizes rows in parallel. Shapes: x f32[R, K]
(C-contiguous, K a multiple of the block size), out u8[R, row_bytes].
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit, prange

from kernels_cpu.ggml_types import TYPES
from quant.c_float import FLT_MAX, HALF, ONE, ZERO, as_int8, bf16_bits, c_byte, fp16_bits, put_fp16, roundf

# bytes per block (the type table's), constants in the kernels
Q8_0_BYTES, Q4_0_BYTES, Q5_0_BYTES, Q4_1_BYTES, Q5_1_BYTES = (
    TYPES[t].type_size for t in (T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1))


@njit(cache=True, error_model="numpy")
def _f16_row(x, out):
    """ggml_fp32_to_fp16_row. Shapes: x f32[K] -> out u8[2K] (little-endian binary16)."""
    for j in range(x.size):
        h = fp16_bits(x[j])
        out[2 * j] = h & 0xFF
        out[2 * j + 1] = h >> 8


@njit(cache=True, error_model="numpy")
def _bf16_row(x, out):
    """ggml_fp32_to_bf16_row_ref. Shapes: x f32[K] -> out u8[2K] (little-endian bfloat16)."""
    for j in range(x.size):
        h = bf16_bits(x[j])
        out[2 * j] = h & 0xFF
        out[2 * j + 1] = h >> 8


@njit(cache=True, error_model="numpy")
def _q8_0_row(x, out):
    """quantize_row_q8_0_ref. Block (34 B): d f16, qs int8[32].
    amax = max|x|; d = amax / 127; id = 1/d (0 if d == 0); qs = roundf(x * id)."""
    for b in range(x.size // 32):
        xb = x[32 * b:32 * b + 32]
        y = out[Q8_0_BYTES * b:Q8_0_BYTES * (b + 1)]
        amax = ZERO
        for j in range(32):
            v = abs(xb[j])
            amax = amax if amax > v else v  # MAX(amax, fabsf(v))
        d = amax / np.float32(127.0)
        inv = ONE / d if d != ZERO else ZERO
        put_fp16(y, 0, d)
        for j in range(32):
            y[2 + j] = c_byte(roundf(xb[j] * inv))


@njit(cache=True, error_model="numpy", inline="always")
def pack_32(q, y, nbits):
    """Store 32 quants q (bytes) at the end of block y. nbits 4: qs[16] with
    qs[j] = q[j] | q[j+16] << 4, cut to a byte as C does. nbits 5: qs[j] = (q[j] & 15) |
    (q[j+16] & 15) << 4, and qh u32 (little-endian, just before qs) with bit j / j+16 = bit 4
    of q[j] / q[j+16]."""
    qs = y[y.size - 16:]
    if nbits == 4:
        for j in range(16):
            qs[j] = (q[j] | (q[j + 16] << 4)) & 0xFF
        return
    qh = 0
    for j in range(16):
        qs[j] = (q[j] & 0xF) | ((q[j + 16] & 0xF) << 4)
        qh |= ((q[j] & 0x10) >> 4) << j
        qh |= ((q[j + 16] & 0x10) >> 4) << (j + 16)
    for k in range(4):
        y[y.size - 20 + k] = (qh >> (8 * k)) & 0xFF


@njit(cache=True, error_model="numpy")
def _q4_0_q5_0_row(x, out, nbits):
    """quantize_row_q4_0_ref (nbits 4) / quantize_row_q5_0_ref (nbits 5).
    Q4_0 block (18 B): d f16, qs[16]; Q5_0 block (22 B): d f16, qh u32, qs[16].
    max = the x of largest |x| (first one); d = max / -8 (-16); id = 1/d (0 if d == 0);
    q = MIN(15 (31), (int8_t)(x * id + 8.5 (16.5))), packed by pack_32."""
    half_levels = 1 << (nbits - 1)
    qmax = 2 * half_levels - 1
    divisor = np.float32(-half_levels)
    offset = np.float32(half_levels) + HALF
    block_bytes = Q4_0_BYTES if nbits == 4 else Q5_0_BYTES
    q = np.empty(32, np.int64)
    for b in range(x.size // 32):
        xb = x[32 * b:32 * b + 32]
        y = out[block_bytes * b:block_bytes * (b + 1)]
        amax = ZERO
        vmax = ZERO
        for j in range(32):
            if amax < abs(xb[j]):
                amax = abs(xb[j])
                vmax = xb[j]
        d = vmax / divisor
        inv = ONE / d if d != ZERO else ZERO
        put_fp16(y, 0, d)
        for j in range(32):
            q[j] = min(qmax, as_int8(c_byte(xb[j] * inv + offset))) & 0xFF
        pack_32(q, y, nbits)


@njit(cache=True, error_model="numpy")
def _q4_1_q5_1_row(x, out, nbits):
    """quantize_row_q4_1_ref (nbits 4) / quantize_row_q5_1_ref (nbits 5).
    Q4_1 block (20 B): d f16, m f16, qs[16]; Q5_1 block (24 B): d, m, qh u32, qs[16].
    d = (max - min) / 15 (31); m = fp16(min); id = 1/d (0 if d == 0);
    Q4_1: q = MIN(15, (int8_t)((x - min) * id + 0.5)); Q5_1: q = (uint8_t)((x - min) * id + 0.5);
    packed by pack_32. Quants use the float32 min and id, not the fp16 ones."""
    levels = np.float32((1 << nbits) - 1)
    block_bytes = Q4_1_BYTES if nbits == 4 else Q5_1_BYTES
    q = np.empty(32, np.int64)
    for b in range(x.size // 32):
        xb = x[32 * b:32 * b + 32]
        y = out[block_bytes * b:block_bytes * (b + 1)]
        vmin = FLT_MAX
        vmax = -FLT_MAX
        for j in range(32):
            if xb[j] < vmin:
                vmin = xb[j]
            if xb[j] > vmax:
                vmax = xb[j]
        d = (vmax - vmin) / levels
        inv = ONE / d if d != ZERO else ZERO
        put_fp16(y, 0, d)
        put_fp16(y, 2, vmin)
        for j in range(32):
            q[j] = c_byte((xb[j] - vmin) * inv + HALF)
            if nbits == 4:
                q[j] = min(15, as_int8(q[j])) & 0xFF
        pack_32(q, y, nbits)

# ---------------------------------------------------------------------------------------------
# per-type parallel kernels. Shapes: x f32[R, K] (C-contiguous), out u8[R, row_bytes].


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_f16(x, out):
    for r in prange(x.shape[0]):
        _f16_row(x[r], out[r])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_bf16(x, out):
    for r in prange(x.shape[0]):
        _bf16_row(x[r], out[r])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q8_0(x, out):
    for r in prange(x.shape[0]):
        _q8_0_row(x[r], out[r])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q4_0(x, out):
    for r in prange(x.shape[0]):
        _q4_0_q5_0_row(x[r], out[r], 4)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q5_0(x, out):
    for r in prange(x.shape[0]):
        _q4_0_q5_0_row(x[r], out[r], 5)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q4_1(x, out):
    for r in prange(x.shape[0]):
        _q4_1_q5_1_row(x[r], out[r], 4)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q5_1(x, out):
    for r in prange(x.shape[0]):
        _q4_1_q5_1_row(x[r], out[r], 5)
