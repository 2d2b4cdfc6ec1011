"""IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S: dequantization (ggml ``dequantize_row_iq*``) and
matmul against Q8_K activations (ggml ``ggml_vec_dot_iq*_q8_K``, the __AVX2__ branch of
ggml-cpu/arch/x86/quants.c), bit for bit as llama.cpp's CPU backend on AVX2.

Block layouts (ggml-common.h, 256 values, all little-endian, ``d`` an f16):

* block_iq2_xxs (66 B): ``d | u16 qs[32]``; per 32 values two u32: four 8-value grid indices
  (bytes of the first), four 7-bit sign indices and a 4-bit scale (top bits of the second).
* block_iq2_xs (74 B): ``d | u16 qs[32] | u8 scales[8]``; per 8 values a 9-bit grid index and a
  7-bit sign index; a 4-bit scale per 16 values.
* block_iq2_s (82 B): ``d | u8 qs[64] | u8 qh[8] | u8 scales[8]``; qs[0:32] the low 8 bits of the
  10-bit grid indices (2 high bits in qh), qs[32:64] explicit sign bytes; 4-bit scales per 16.
* block_iq3_xxs (98 B): ``d | u8 qs[96]``; qs[0:64] 4-value grid indices, then per 32 values a
  u32 of four 7-bit sign indices and a 4-bit scale.
* block_iq3_s (110 B): ``d | u8 qs[64] | u8 qh[8] | u8 signs[32] | u8 scales[4]``; 9-bit
  4-value grid indices (high bit in qh), explicit sign bytes, a 4-bit scale per 32 values.

Grids and the sign table come from gguf.quants (IQ2_XXS.ksigns and each class's grid), turned
into uint8 arrays at import. Sign index s stands for the byte ksigns[s] (bit j set: value j
negated).

Matmul arithmetic (every type): each value's product w * q (w the signed grid value, q the
activation quant) is summed in integers into lane (j % 32) // 4 of 8 int32 lanes (j the value's
index in the block), times the integer scale 2 * s + 1 of its 32 or 16 values (exact: the
AVX2 maddubs / madd sums never saturate); per block ``acc[l] = fma(d_w * d_x, float(isum[l]),
acc[l])``; at the end hsum_float_8(acc) times 1/8 (IQ2_*), 1/4 (IQ3_XXS) or 1 (IQ3_S).
llama.cpp runs this vec_dot per activation row for T < 8; for T >= 8 it takes its tiled kernels
(ggml-cpu/tiled): one exact integer sum per block, ``acc = fma((d_w * factor) * float(sum),
d_x, acc)``, which matmul_<type>_q8_k mirror; the ``_bi`` kernels keep the vec_dot arithmetic
for every T (batch-invariant).

Shapes: dequant_<type>(raw uint8[nb * type_size], out float32[256 nb]);
matmul_<type>_q8_k(w uint8[R, row_bytes], xqs int8|int16[T, K], xd float32[T, K/256],
xbsums int16[T, K/16] (unused), out float32[T, R]).
"""
from __future__ import annotations

import numpy as np
from gguf import quants as gq
from numba import njit, prange

from kernels_cpu.fmath import fma
from kernels_cpu.simd import load_f16


def _grid(cls) -> np.ndarray:
    """uint8[N, values per index] of gguf's grid for ``cls`` (its float values are small integers)."""
    cls.init_grid()
    g = np.asarray(cls.grid, np.float32).reshape(cls.grid_shape)
    out = g.astype(np.uint8)
    assert np.array_equal(out.astype(np.float32), g)
    return np.ascontiguousarray(out)


IQ2XXS_GRID, IQ2XS_GRID, IQ2S_GRID = _grid(gq.IQ2_XXS), _grid(gq.IQ2_XS), _grid(gq.IQ2_S)
IQ3XXS_GRID, IQ3S_GRID = _grid(gq.IQ3_XXS), _grid(gq.IQ3_S)
KSIGNS = np.frombuffer(gq.IQ2_XXS.ksigns, np.uint8).copy()  # ggml ksigns_iq2xs[128]
# SIGN_BITS[s, j] = -1 where bit j of the sign byte s is set, else 1 (ggml kmask_iq2xs[j] = 1 << j)
SIGN_BITS = np.where((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1, -1, 1).astype(np.int8)

# kinds (the type's IQ code in these kernels)
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S = 0, 1, 2, 3, 4
_BYTES = (66, 74, 82, 98, 110)
_FACTOR = (np.float32(0.125), np.float32(0.125), np.float32(0.125), np.float32(0.25), np.float32(1.0))


@njit(cache=True, inline="always")
def _u32(raw, p):
    return (np.uint32(raw[p]) | (np.uint32(raw[p + 1]) << np.uint32(8)) | (np.uint32(raw[p + 2]) << np.uint32(16))
            | (np.uint32(raw[p + 3]) << np.uint32(24)))


@njit(cache=True, inline="always")
def _put(w, o, grid, idx, n, sign):
    """w[o:o+n] = grid[idx] with the values whose bit is set in ``sign`` (from bit ``o % 8``) negated."""
    for j in range(n):
        w[o + j] = np.int32(grid[idx, j]) * np.int32(SIGN_BITS[sign, (o + j) % 8])


@njit(cache=True, inline="always")
def _decode(kind, raw, p, w, ls):
    """Block at raw[p:]: signed grid values w int32[256] and 4-bit scales ls int32[16] (one per 16 values)."""
    if kind == IQ2_XXS:
        for ib in range(8):
            a0, a1 = _u32(raw, p + 2 + 8 * ib), _u32(raw, p + 6 + 8 * ib)
            for k in range(4):
                s = KSIGNS[(a1 >> np.uint32(7 * k)) & np.uint32(127)]
                _put(w, 32 * ib + 8 * k, IQ2XXS_GRID, (a0 >> np.uint32(8 * k)) & np.uint32(255), 8, s)
            ls[2 * ib] = ls[2 * ib + 1] = np.int32(a1 >> np.uint32(28))
    elif kind == IQ2_XS:
        for g in range(32):
            q = np.int32(raw[p + 2 + 2 * g]) | (np.int32(raw[p + 3 + 2 * g]) << 8)
            _put(w, 8 * g, IQ2XS_GRID, q & 511, 8, KSIGNS[q >> 9])
        for g in range(16):
            ls[g] = (np.int32(raw[p + 66 + g // 2]) >> (4 * (g % 2))) & 15
    elif kind == IQ2_S:
        for g in range(32):
            idx = np.int32(raw[p + 2 + g]) | (((np.int32(raw[p + 66 + g // 4]) >> (2 * (g % 4))) & 3) << 8)
            _put(w, 8 * g, IQ2S_GRID, idx, 8, raw[p + 34 + g])
        for g in range(16):
            ls[g] = (np.int32(raw[p + 74 + g // 2]) >> (4 * (g % 2))) & 15
    elif kind == IQ3_XXS:
        for ib in range(8):
            a = _u32(raw, p + 66 + 4 * ib)
            for k in range(4):
                s = KSIGNS[(a >> np.uint32(7 * k)) & np.uint32(127)]
                _put(w, 32 * ib + 8 * k, IQ3XXS_GRID, raw[p + 2 + 8 * ib + 2 * k], 4, s)
                _put(w, 32 * ib + 8 * k + 4, IQ3XXS_GRID, raw[p + 3 + 8 * ib + 2 * k], 4, s)
            ls[2 * ib] = ls[2 * ib + 1] = np.int32(a >> np.uint32(28))
    else:  # IQ3_S
        for ib in range(8):
            qh = np.int32(raw[p + 66 + ib])
            for k in range(8):
                idx = np.int32(raw[p + 2 + 8 * ib + k]) | (((qh >> k) & 1) << 8)
                _put(w, 32 * ib + 4 * k, IQ3S_GRID, idx, 4, raw[p + 74 + 4 * ib + k // 2])
            ls[2 * ib] = ls[2 * ib + 1] = (np.int32(raw[p + 106 + ib // 2]) >> (4 * (ib % 2))) & 15


@njit(cache=True, inline="always")
def _dequant(kind, raw, out):
    """ggml dequantize_row_<kind> / gguf dequantize_blocks: x = (db * grid) * (+-1), db per 16 values."""
    w = np.empty(256, np.int32)
    ls = np.empty(16, np.int32)
    nbytes = _BYTES[kind]
    for b in range(out.size // 256):
        p, o = nbytes * b, 256 * b
        _decode(kind, raw, p, w, ls)
        d = load_f16(raw, p)
        for g in range(16):
            if kind == IQ3_S:
                db = d * np.float32(1 + 2 * ls[g])
            elif kind == IQ3_XXS:
                db = d * (np.float32(0.5) + np.float32(ls[g])) * np.float32(0.5)
            else:
                db = d * (np.float32(0.5) + np.float32(ls[g])) * np.float32(0.25)
            for j in range(16 * g, 16 * g + 16):
                v = db * np.float32(abs(w[j]))
                out[o + j] = -v if w[j] < 0 else v


@njit(cache=True, nogil=True)
def dequant_iq2_xxs(raw, out):
    """IQ2_XXS (block_iq2_xxs, 66 B / 256 values), as dequantize_row_iq2_xxs."""
    _dequant(IQ2_XXS, raw, out)


@njit(cache=True, nogil=True)
def dequant_iq2_xs(raw, out):
    """IQ2_XS (block_iq2_xs, 74 B / 256 values), as dequantize_row_iq2_xs."""
    _dequant(IQ2_XS, raw, out)


@njit(cache=True, nogil=True)
def dequant_iq2_s(raw, out):
    """IQ2_S (block_iq2_s, 82 B / 256 values), as dequantize_row_iq2_s."""
    _dequant(IQ2_S, raw, out)


@njit(cache=True, nogil=True)
def dequant_iq3_xxs(raw, out):
    """IQ3_XXS (block_iq3_xxs, 98 B / 256 values), as dequantize_row_iq3_xxs."""
    _dequant(IQ3_XXS, raw, out)


@njit(cache=True, nogil=True)
def dequant_iq3_s(raw, out):
    """IQ3_S (block_iq3_s, 110 B / 256 values), as dequantize_row_iq3_s."""
    _dequant(IQ3_S, raw, out)


@njit(cache=True, inline="always")
def _matmul(kind, w, xqs, xd, out, batch_tiled):
    """out[t, r] = ggml_vec_dot_<kind>_q8_K(row r, activation row t) for every t, r (module
    docstring); with ``batch_tiled`` and T >= 8, llama.cpp's tiled arithmetic instead
    (ggml-cpu/tiled tiled_run_microtile_avx2: per block ``acc = fma((d_w * factor) *
    float(block integer sum), d_x, acc)``)."""
    n_t, n_b = xqs.shape[0], xqs.shape[1] // 256
    tiled = batch_tiled and n_t >= 8
    nbytes, factor = _BYTES[kind], _FACTOR[kind]
    for r in prange(w.shape[0]):
        vals = np.empty(256, np.int32)
        ls = np.empty(16, np.int32)
        acc = np.zeros((n_t, 8), np.float32)
        row = w[r]
        for b in range(n_b):
            _decode(kind, row, nbytes * b, vals, ls)
            for g in range(16):
                sc = 2 * ls[g] + 1
                for j in range(16 * g, 16 * g + 16):
                    vals[j] *= sc
            dw = load_f16(row, nbytes * b)
            for t in range(n_t):
                xt = xqs[t, 256 * b:256 * b + 256]
                d = dw * xd[t, b]
                total = np.int32(0)
                for lane in range(8):
                    isum = np.int32(0)
                    for sub in range(8):
                        j = 32 * sub + 4 * lane
                        isum += (vals[j] * np.int32(xt[j]) + vals[j + 1] * np.int32(xt[j + 1])
                                 + vals[j + 2] * np.int32(xt[j + 2]) + vals[j + 3] * np.int32(xt[j + 3]))
                    if tiled:
                        total += isum
                    else:
                        acc[t, lane] = fma(d, np.float32(isum), acc[t, lane])
                if tiled:
                    acc[t, 0] = fma((dw * factor) * np.float32(total), xd[t, b], acc[t, 0])
        for t in range(n_t):
            if tiled:
                out[t, r] = acc[t, 0]
                continue
            a = acc[t]
            s0, s1, s2, s3 = a[4] + a[0], a[5] + a[1], a[6] + a[2], a[7] + a[3]
            out[t, r] = factor * ((s0 + s2) + (s1 + s3))


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq2_xxs_q8_k(w, xqs, xd, xbsums, out):
    """IQ2_XXS x Q8_K as llama.cpp: ggml_vec_dot_iq2_xxs_q8_K (AVX2) per activation row, tiled for T >= 8."""
    _matmul(IQ2_XXS, w, xqs, xd, out, True)


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq2_xs_q8_k(w, xqs, xd, xbsums, out):
    """IQ2_XS x Q8_K as llama.cpp: ggml_vec_dot_iq2_xs_q8_K (AVX2) per activation row, tiled for T >= 8."""
    _matmul(IQ2_XS, w, xqs, xd, out, True)


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq2_s_q8_k(w, xqs, xd, xbsums, out):
    """IQ2_S x Q8_K as llama.cpp: ggml_vec_dot_iq2_s_q8_K (AVX2) per activation row, tiled for T >= 8."""
    _matmul(IQ2_S, w, xqs, xd, out, True)


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq3_xxs_q8_k(w, xqs, xd, xbsums, out):
    """IQ3_XXS x Q8_K as llama.cpp: ggml_vec_dot_iq3_xxs_q8_K (AVX2) per activation row, tiled for T >= 8."""
    _matmul(IQ3_XXS, w, xqs, xd, out, True)


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq3_s_q8_k(w, xqs, xd, xbsums, out):
    """IQ3_S x Q8_K as llama.cpp: ggml_vec_dot_iq3_s_q8_K (AVX2) per activation row, tiled for T >= 8."""
    _matmul(IQ3_S, w, xqs, xd, out, True)


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq2_xxs_q8_k_bi(w, xqs, xd, xbsums, out):
    """IQ2_XXS x Q8_K, batch-invariant: the vec_dot arithmetic (llama.cpp's for T = 1) for every T."""
    _matmul(IQ2_XXS, w, xqs, xd, out, False)


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq2_xs_q8_k_bi(w, xqs, xd, xbsums, out):
    """IQ2_XS x Q8_K, batch-invariant: the vec_dot arithmetic (llama.cpp's for T = 1) for every T."""
    _matmul(IQ2_XS, w, xqs, xd, out, False)


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq2_s_q8_k_bi(w, xqs, xd, xbsums, out):
    """IQ2_S x Q8_K, batch-invariant: the vec_dot arithmetic (llama.cpp's for T = 1) for every T."""
    _matmul(IQ2_S, w, xqs, xd, out, False)


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq3_xxs_q8_k_bi(w, xqs, xd, xbsums, out):
    """IQ3_XXS x Q8_K, batch-invariant: the vec_dot arithmetic (llama.cpp's for T = 1) for every T."""
    _matmul(IQ3_XXS, w, xqs, xd, out, False)


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq3_s_q8_k_bi(w, xqs, xd, xbsums, out):
    """IQ3_S x Q8_K, batch-invariant: the vec_dot arithmetic (llama.cpp's for T = 1) for every T."""
    _matmul(IQ3_S, w, xqs, xd, out, False)
