"""Quantization of float32 activations to the int8 block formats of ggml's dot products.

A quantized matmul first converts x to its weight type's ``vec_dot_type`` (ggml-cpu.c
``type_traits_cpu``): Q8_0 for Q4_0/Q5_0/Q8_0 weights, Q8_1 for Q4_1/Q5_1, Q8_K for the
K-quants. These kernels mirror the functions llama.cpp's CPU backend runs on x86-64
(ggml-cpu/arch/x86/quants.c, AVX2 build):

* ``quantize_row_q8_0``: per 32 values, amax = max|x|; d = amax / 127 (stored as f16);
  q = round_half_even(x * (127 / amax)), or 0 when amax == 0.
* ``quantize_row_q8_1``: as Q8_0, plus s = f16(d * sum(q)) with the float32 (unrounded) d.
* ``quantize_row_q8_K`` (= ggml-quants.c ``quantize_row_q8_K_ref``): per 256 values, take the
  signed value ``max`` of largest magnitude (the first one on ties); iscale = -127 / max;
  q = min(127, nearest_int(iscale * x)); d = 1 / iscale (float32, not rounded);
  bsums = sums of q over groups of 16. An all-zero block gives d = 0, q = 0, bsums = 0.
  (The repacked Q4_K/Q2_K gemm quantizes with ggml_quantize_mat_q8_K_4x8, which takes +max
  on a +max/-max tie; that flips the signs of q, d and bsums together, so every matmul result
  is the same and one quantizer serves both.)

(ggml's portable ``quantize_row_q8_0_ref`` differs slightly: it multiplies by 1/d and rounds
half away from zero, so a rare tie can differ by one unit.) f16-stored scales are returned as
float32 holding the f16-rounded value, which is what ggml's dot products use. All arithmetic
is float32 as in ggml. Inputs must be finite: NaN or Inf give unspecified (memory-safe) results,
never an exception.

Shapes (T rows of K values): x float32[T, K] -> qs int8[T, K] plus, per format,
Q8_0: d float32[T, K/32]; Q8_1: d, s float32[T, K/32]; Q8_K: d float32[T, K/256],
bsums int16[T, K/16]. Output buffers may be passed in, so a decode loop allocates nothing; a
qs buffer may also be int16 (the same values, widened: the form matmul's kernels read fastest).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels_cpu.dequant import QuantFormatError
from kernels_cpu.f16 import f16_to_f32, f32_to_f16
from kernels_cpu.ggml_types import QK8_0, QK_K  # values per Q8_0 / Q8_1 block, per Q8_K super-block
from kernels_cpu.simd import bits_from_f32, f32_from_bits

_F32, _I16 = (np.dtype(np.float32),), (np.dtype(np.int16),)
QS_DTYPES = (np.dtype(np.int8), np.dtype(np.int16))  # qs buffers: int8 (ggml's layout) or int16 (widened for matmul)
_F127 = np.float32(127.0)
_FM127 = np.float32(-127.0)
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)
_ROUND_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: adding it rounds to an integer, ties to even


@njit(cache=True, inline="always")
def nearest_int(v):
    """Round float32 ``v`` to the nearest integer, ties to even (ggml nearest_int); |v| < 2**22."""
    return np.int32(bits_from_f32(v + _ROUND_MAGIC) & np.uint32(0x007FFFFF)) - np.int32(0x00400000)


@njit(cache=True, inline="always")
def _q8_0_row(x, qs, d, s, with_sum):
    """One row to Q8_0 (and the Q8_1 sums when ``with_sum``); see the module docstring."""
    for b in range(x.size // QK8_0):
        o = QK8_0 * b
        amax_bits = np.uint32(0)  # max |x| through the bit patterns: exact for finite floats
        for j in range(o, o + QK8_0):
            amax_bits = max(amax_bits, bits_from_f32(x[j]) & np.uint32(0x7FFFFFFF))
        amax = f32_from_bits(amax_bits)
        scale = amax / _F127
        d[b] = f16_to_f32(f32_to_f16(scale))
        inv = _F127 / amax if amax != _ZERO else _ZERO
        total = 0
        for j in range(o, o + QK8_0):
            q = min(max(nearest_int(x[j] * inv), -128), 127)
            qs[j] = q
            total += q
        if with_sum:
            s[b] = f16_to_f32(f32_to_f16(scale * np.float32(total)))


@njit(cache=True, inline="always")
def _q8_k_block(x, qs, d, bsums, b):
    """Super-block b of one row to Q8_K; see the module docstring. max |x| through the bit
    patterns (a loop LLVM vectorizes; exact for finite floats), then the first value of that
    magnitude: the value ggml's scan (``ax > amax``) keeps."""
    o = QK_K * b
    amax_bits = np.uint32(0)
    for j in range(o, o + QK_K):
        amax_bits = max(amax_bits, bits_from_f32(x[j]) & np.uint32(0x7FFFFFFF))
    amax = f32_from_bits(amax_bits)
    if amax == _ZERO:
        d[b] = _ZERO
        qs[o:o + QK_K] = 0
        bsums[16 * b:16 * b + 16] = 0
        return
    vmax = amax                                   # (a NaN amax matches nothing: unspecified, memory-safe)
    for j in range(o, o + QK_K):
        if abs(x[j]) == amax:
            vmax = x[j]
            break
    iscale = _FM127 / vmax
    for j in range(o, o + QK_K):
        qs[j] = min(nearest_int(iscale * x[j]), 127)
    for g in range(16):
        total = 0
        for j in range(o + 16 * g, o + 16 * g + 16):
            total += qs[j]
        bsums[16 * b + g] = total
    d[b] = _ONE / iscale


@njit(cache=True, inline="always")
def _q8_k_row(x, qs, d, bsums):
    """One row to Q8_K; see the module docstring."""
    for b in range(x.size // QK_K):
        _q8_k_block(x, qs, d, bsums, b)


@njit(cache=True, nogil=True)
def quantize_q8_0_kernel(x, qs, d):
    """Q8_0 rows. Shapes: x f32[T, K], qs i8[T, K], d f32[T, K/32]."""
    for t in range(x.shape[0]):
        _q8_0_row(x[t], qs[t], d[t], d[t], False)


@njit(cache=True, nogil=True)
def quantize_q8_1_kernel(x, qs, d, s):
    """Q8_1 rows. Shapes: x f32[T, K], qs i8[T, K], d and s f32[T, K/32]."""
    for t in range(x.shape[0]):
        _q8_0_row(x[t], qs[t], d[t], s[t], True)


@njit(cache=True, nogil=True, error_model="numpy")   # an infinite max: d = 1 / -0.0, no exception
def _quantize_q8_k_rows(x, qs, d, bsums):
    for t in range(x.shape[0]):
        _q8_k_row(x[t], qs[t], d[t], bsums[t])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _quantize_q8_k_par(x, qs, d, bsums):
    nb = x.shape[1] // QK_K
    for tb in prange(x.shape[0] * nb):      # super-blocks are independent: shared out one by one
        t = tb // nb
        _q8_k_block(x[t], qs[t], d[t], bsums[t], tb % nb)


def quantize_q8_k_kernel(x, qs, d, bsums):
    """Q8_K rows (from 4 rows: super-blocks in parallel; one row of 8960 values takes 4 us on
    the calling thread, less than waking the workers). Shapes: x f32[T, K], qs i8[T, K],
    d f32[T, K/256], bsums i16[T, K/16]."""
    if x.shape[0] >= 4:
        _quantize_q8_k_par(x, qs, d, bsums)
    else:
        _quantize_q8_k_rows(x, qs, d, bsums)


# ---------------------------------------------------------------------------------------------
# Python entry points: validation, optional output buffers


def _check_x(x, block: int, fmt: str) -> tuple[int, int]:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        raise QuantFormatError(f"{fmt}: x must be a C-contiguous float32[T, K] array, got "
                               f"{getattr(x, 'dtype', type(x))} {getattr(x, 'shape', '')}")
    if x.shape[1] % block:
        raise QuantFormatError(f"{fmt}: row length {x.shape[1]} is not a multiple of the block size {block}")
    return x.shape


def _buffer(buf, shape: tuple[int, int], dtypes: tuple, name: str, fmt: str) -> np.ndarray:
    """``buf`` checked (dtype one of ``dtypes``, shape, layout), or a new array of dtypes[0]."""
    if buf is None:
        return np.empty(shape, dtypes[0])
    if (not isinstance(buf, np.ndarray) or buf.dtype not in dtypes or buf.shape != shape
            or not buf.flags.c_contiguous or not buf.flags.writeable):
        raise QuantFormatError(f"{fmt}: {name} must be a writeable C-contiguous {'/'.join(np.dtype(t).name for t in dtypes)}"
                               f"{list(shape)} array, got {getattr(buf, 'dtype', type(buf))} "
                               f"{getattr(buf, 'shape', '')}")
    return buf


def quantize_q8_0(x: np.ndarray, qs: np.ndarray | None = None, d: np.ndarray | None = None):
    """x float32[T, K] -> (qs int8[T, K], d float32[T, K/32]) as ggml quantize_row_q8_0.

    ``qs``/``d`` are filled in place when given. Raises QuantFormatError on a bad shape/dtype.
    """
    T, K = _check_x(x, QK8_0, "Q8_0")
    qs = _buffer(qs, (T, K), QS_DTYPES, "qs", "Q8_0")
    d = _buffer(d, (T, K // QK8_0), _F32, "d", "Q8_0")
    quantize_q8_0_kernel(x, qs, d)
    return qs, d


def quantize_q8_1(x: np.ndarray, qs: np.ndarray | None = None, d: np.ndarray | None = None,
                  s: np.ndarray | None = None):
    """x float32[T, K] -> (qs int8[T, K], d float32[T, K/32], s float32[T, K/32]) as ggml quantize_row_q8_1.

    ``s`` = f16(d * sum(qs of the block)). Buffers are filled in place when given.
    """
    T, K = _check_x(x, QK8_0, "Q8_1")
    qs = _buffer(qs, (T, K), QS_DTYPES, "qs", "Q8_1")
    d = _buffer(d, (T, K // QK8_0), _F32, "d", "Q8_1")
    s = _buffer(s, (T, K // QK8_0), _F32, "s", "Q8_1")
    quantize_q8_1_kernel(x, qs, d, s)
    return qs, d, s


def quantize_q8_k(x: np.ndarray, qs: np.ndarray | None = None, d: np.ndarray | None = None,
                  bsums: np.ndarray | None = None):
    """x float32[T, K] -> (qs int8[T, K], d float32[T, K/256], bsums int16[T, K/16]) as ggml quantize_row_q8_K.

    Buffers are filled in place when given. Raises QuantFormatError on a bad shape/dtype.
    """
    T, K = _check_x(x, QK_K, "Q8_K")
    qs = _buffer(qs, (T, K), QS_DTYPES, "qs", "Q8_K")
    d = _buffer(d, (T, K // QK_K), _F32, "d", "Q8_K")
    bsums = _buffer(bsums, (T, K // 16), _I16, "bsums", "Q8_K")
    quantize_q8_k_kernel(x, qs, d, bsums)
    return qs, d, bsums
