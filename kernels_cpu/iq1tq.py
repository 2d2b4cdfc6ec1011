"""IQ1_S, IQ1_M, TQ1_0 and TQ2_0: dequantization and matmul kernels, bit for bit as ggml's CPU backend.

Dequant kernels ``dequant_<type>(raw, out)`` (raw uint8[n_blocks * type_size], out
float32[256 n_blocks]) mirror ggml-quants.c dequantize_row_iq1_s / _iq1_m / _tq1_0 / _tq2_0
(= gguf.quants.dequantize): float32 products in the same order, no FMA.

Matmul kernels ``matmul_<type>_q8_k(w, xqs, xd, xbsums, out)`` (w uint8[R, row_bytes], xqs
int16[T, K], xd float32[T, K/256], xbsums int16[T, K/16], out float32[T, R]; the Q8_K
activations of kernels_cpu.quantize_act) mirror the __AVX2__ branch of ggml_vec_dot_<type>_q8_K
(ggml-cpu/arch/x86/quants.c) as GCC compiles it (-ffp-contract=fast): integer sums are exact,
so only the float steps are reproduced: per 256-value block, 8 int32 lanes (lane m holding the
values v with v % 32 in [4m, 4m + 4)) meet d = y.d * f16(x.d) in one fma per lane, the IQ1_S
delta term is a scalar fma chain, and the result is hsum_float_8 of the lanes (plus 0.125 times
the delta sum). No tinyBLAS, no repacking for these types; but for batches of T >= 8 llama.cpp
runs IQ1_S / IQ1_M through its tiled matmul (ggml-cpu/tiled, ggml_tiled_min_batch), whose
float order differs (_iq1_tiled_row); ``..._bi`` kernels keep vec_dot's arithmetic for every T.
TQ1_0 / TQ2_0 run vec_dot at every T.

The iq1s_grid (2048 x 8 values in {-1, 0, 1}) is read from gguf.quants.IQ1_S.
"""
from __future__ import annotations

import numpy as np
from gguf.quants import IQ1_S as _GGUF_IQ1_S
from numba import njit, prange

from kernels_cpu.fmath import fma
from kernels_cpu.simd import f16_bits_to_f32, load_f16

QK_K = 256
IQ1S_BYTES, IQ1M_BYTES, TQ1_0_BYTES, TQ2_0_BYTES = 50, 56, 54, 66  # block_iq1_s / _iq1_m / _tq1_0 / _tq2_0


def _iq1s_grid() -> np.ndarray:
    """int8[2048, 8]: ggml's iq1s_grid as gguf.quants builds it (IQ1_S.init_grid)."""
    _GGUF_IQ1_S.init_grid()
    return np.ascontiguousarray(_GGUF_IQ1_S.grid.reshape(2048, 8).astype(np.int8))


IQ1S_GRID = _iq1s_grid()
_DELTA = np.float32(0.125)  # IQ1S_DELTA = IQ1M_DELTA


@njit(cache=True, inline="always")
def _u16(raw, p):
    return np.int32(raw[p]) | (np.int32(raw[p + 1]) << 8)


@njit(cache=True, inline="always")
def _trit(q, power):
    """Trit of byte q at position ``power`` (3**n mod 256): ((uint8)(q * 3**n) * 3) >> 8, as
    dequantize_row_tq1_0 (and the AVX2 avg trick) compute it; 0..2."""
    return ((np.int32(q) * power) & 0xFF) * 3 >> 8


@njit(cache=True, inline="always")
def _iq1m_d(raw, p):
    """f16 scale of an IQ1_M block, spread over the top nibbles of its 4 uint16 scales."""
    s = p + 48
    bits = ((_u16(raw, s) >> 12) | ((_u16(raw, s + 2) >> 8) & 0x00F0) | ((_u16(raw, s + 4) >> 4) & 0x0F00)
            | (_u16(raw, s + 6) & 0xF000))
    return f16_bits_to_f32(np.uint32(bits))


# ---------------------------------------------------------------------------------------------
# dequantization


@njit(cache=True, nogil=True)
def dequant_iq1_s(raw, out):
    """IQ1_S (block_iq1_s, 50 bytes / 256 values): ``f16 d | u8 qs[32] | u16 qh[8]``.

    Sub-block ib (32 values): dl = d * (2 * ((qh >> 12) & 7) + 1), delta = -0.125 if qh bit 15
    else 0.125; group l (8 values) = dl * (iq1s_grid[qs[4ib+l] | ((qh >> 3l) & 7) << 8] + delta)
    (dequantize_row_iq1_s). Shapes: uint8[50 nb] -> float32[256 nb].
    """
    for b in range(out.size // QK_K):
        p, o = IQ1S_BYTES * b, QK_K * b
        d = load_f16(raw, p)
        for ib in range(8):
            h = _u16(raw, p + 34 + 2 * ib)
            dl = d * np.float32(2 * ((h >> 12) & 7) + 1)
            delta = -_DELTA if h & 0x8000 else _DELTA
            for lg in range(4):
                idx = np.int32(raw[p + 2 + 4 * ib + lg]) | (((h >> (3 * lg)) & 7) << 8)
                for j in range(8):
                    out[o + 32 * ib + 8 * lg + j] = dl * (np.float32(IQ1S_GRID[idx, j]) + delta)


@njit(cache=True, nogil=True)
def dequant_iq1_m(raw, out):
    """IQ1_M (block_iq1_m, 56 bytes / 256 values): ``u8 qs[32] | u8 qh[16] | u16 scales[4]`` (no d:
    the f16 scale is the top nibbles of scales[0..3]).

    Sub-block ib: 3-bit scales s1, s2 = scales[ib/2] >> (6 (ib%2)) and >> (6 (ib%2) + 3); group
    l: index qs[4ib+l] | (qh[2ib + l/2] >> 4 (l%2) & 7) << 8, delta sign bit 3 of that nibble;
    value = (d * (2s+1)) * (grid + delta) (dequantize_row_iq1_m). uint8[56 nb] -> float32[256 nb].
    """
    for b in range(out.size // QK_K):
        p, o = IQ1M_BYTES * b, QK_K * b
        d = _iq1m_d(raw, p)
        for ib in range(8):
            sc = _u16(raw, p + 48 + 2 * (ib // 2))
            for lg in range(4):
                s = (sc >> (6 * (ib % 2) + 3 * (lg // 2))) & 7
                dl = d * np.float32(2 * s + 1)
                nib = (np.int32(raw[p + 32 + 2 * ib + lg // 2]) >> (4 * (lg % 2))) & 0xF
                delta = -_DELTA if nib & 8 else _DELTA
                idx = np.int32(raw[p + 4 * ib + lg]) | ((nib & 7) << 8)
                for j in range(8):
                    out[o + 32 * ib + 8 * lg + j] = dl * (np.float32(IQ1S_GRID[idx, j]) + delta)


@njit(cache=True, inline="always")
def _tq1_codes(raw, p, q):
    """The 256 trits (0..2) of the TQ1_0 block at raw[p] into q (int32[256]), in value order:
    qs[0:32] x 3**0..4, qs[32:48] x 3**0..4, qh[0:4] x 3**0..3 (dequantize_row_tq1_0)."""
    power = 1
    for n in range(5):
        for m in range(32):
            q[32 * n + m] = _trit(raw[p + m], power)
        for m in range(16):
            q[160 + 16 * n + m] = _trit(raw[p + 32 + m], power)
        if n < 4:
            for m in range(4):
                q[240 + 4 * n + m] = _trit(raw[p + 48 + m], power)
        power *= 3


@njit(cache=True, inline="always")
def _tq2_codes(raw, p, q):
    """The 256 codes (0..3) of the TQ2_0 block at raw[p]: value 128 j + 32 l + m is bits 2l..2l+1
    of qs[32 j + m] (dequantize_row_tq2_0)."""
    for j in range(2):
        for lg in range(4):
            for m in range(32):
                q[128 * j + 32 * lg + m] = (np.int32(raw[p + 32 * j + m]) >> (2 * lg)) & 3


@njit(cache=True, inline="always")
def _tq_block(raw, b, is_1, q):
    """Codes (into q int32[256]) and f16 scale d of TQ1_0 (is_1) / TQ2_0 block b of raw."""
    if is_1:
        p = TQ1_0_BYTES * b
        _tq1_codes(raw, p, q)
        return load_f16(raw, p + 52)
    p = TQ2_0_BYTES * b
    _tq2_codes(raw, p, q)
    return load_f16(raw, p + 64)


@njit(cache=True, inline="always")
def _dequant_tq(raw, out, is_1):
    q = np.empty(QK_K, np.int32)
    for b in range(out.size // QK_K):
        d = _tq_block(raw, b, is_1, q)
        for v in range(QK_K):
            out[QK_K * b + v] = np.float32(q[v] - 1) * d


@njit(cache=True, nogil=True)
def dequant_tq1_0(raw, out):
    """TQ1_0 (block_tq1_0, 54 bytes / 256 values): ``u8 qs[48] | u8 qh[4] | f16 d``, base-3 packed
    trits (see _tq1_codes); x = (trit - 1) * d. Shapes: uint8[54 nb] -> float32[256 nb]."""
    _dequant_tq(raw, out, True)


@njit(cache=True, nogil=True)
def dequant_tq2_0(raw, out):
    """TQ2_0 (block_tq2_0, 66 bytes / 256 values): ``u8 qs[64] | f16 d``, 2-bit codes (see
    _tq2_codes); x = (code - 1) * d. Shapes: uint8[66 nb] -> float32[256 nb]."""
    _dequant_tq(raw, out, False)


# ---------------------------------------------------------------------------------------------
# matmul


@njit(cache=True, inline="always")
def _hsum8(a):
    """hsum_float_8: (a0+a4 + a2+a6) + (a1+a5 + a3+a7), float32."""
    r0, r1, r2, r3 = a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]
    return (r0 + r2) + (r1 + r3)


@njit(cache=True, inline="always")
def _iq1_codes(raw, p, is_m, g, ls, sgn):
    """Decode one IQ1_S / IQ1_M block: g int32[256] grid values (-1..1); ls int32[16] the odd
    scale 2s+1 of each 16 values; sgn int32[16] the delta sign (+1 / -1) of each 16 values
    (IQ1_S: one per 32 values; IQ1_M: one per 8 values, stored per 8 in sgn8 below)."""
    for ib in range(8):
        if is_m:
            sc = _u16(raw, p + 48 + 2 * (ib // 2))
            for half in range(2):
                ls[2 * ib + half] = 2 * ((sc >> (6 * (ib % 2) + 3 * half)) & 7) + 1
        else:
            h = _u16(raw, p + 34 + 2 * ib)
            ls[2 * ib] = ls[2 * ib + 1] = 2 * ((h >> 12) & 7) + 1
        for lg in range(4):
            if is_m:
                nib = (np.int32(raw[p + 32 + 2 * ib + lg // 2]) >> (4 * (lg % 2))) & 0xF
                idx = np.int32(raw[p + 4 * ib + lg]) | ((nib & 7) << 8)
                sgn[4 * ib + lg] = -1 if nib & 8 else 1
            else:
                idx = np.int32(raw[p + 2 + 4 * ib + lg]) | (((h >> (3 * lg)) & 7) << 8)
                sgn[4 * ib + lg] = -1 if h & 0x8000 else 1
            for j in range(8):
                g[32 * ib + 8 * lg + j] = IQ1S_GRID[idx, j]


@njit(cache=True, inline="always")
def _lanes(q, xqs, t, k0, ls, lanes):
    """lanes[m] = sum over sub-blocks ib of ls[2 ib + (v%32)//16] * q[v] * y[v] for the values v of
    the block with (v % 32) // 4 == m (the int32 lanes of _mm256_madd_epi16; exact)."""
    for m in range(8):
        lanes[m] = 0
    for ib in range(8):
        for m in range(8):
            s = 0
            for j in range(4 * m, 4 * m + 4):
                s += q[32 * ib + j] * np.int32(xqs[t, k0 + 32 * ib + j])
            lanes[m] += ls[2 * ib + m // 4] * s


@njit(cache=True, inline="always")
def _iq1_row(raw, r, is_m, xqs, xd, xbsums, out, g, sv, ls, sgn, lanes, lanes2, acc, acc2, acc1):
    """One weight row of IQ1_S (ggml_vec_dot_iq1_s_q8_K) or IQ1_M (ggml_vec_dot_iq1_m_q8_K) for
    every activation row; the other arguments are per-thread scratch arrays."""
    T, nb = xqs.shape[0], xqs.shape[1] // QK_K
    acc[:] = 0
    acc2[:] = 0
    acc1[:] = 0
    bb = IQ1M_BYTES if is_m else IQ1S_BYTES
    for b in range(nb):
        p, k0 = bb * b, QK_K * b
        _iq1_codes(raw, p, is_m, g, ls, sgn)
        dw = _iq1m_d(raw, p) if is_m else load_f16(raw, p)
        if is_m:
            for v in range(QK_K):
                sv[v] = sgn[v // 8]
        for t in range(T):
            _lanes(g, xqs, t, k0, ls, lanes)
            d = xd[t, b] * dw
            for m in range(8):
                acc[t, m] = fma(d, np.float32(lanes[m]), acc[t, m])
            if is_m:  # sumi2: the delta signs times y, times the scales; its own fma lanes
                _lanes(sv, xqs, t, k0, ls, lanes2)
                for m in range(8):
                    acc2[t, m] = fma(d, np.float32(lanes2[m]), acc2[t, m])
            else:  # sumi1: the bsums of each 32 values, signed and scaled; a scalar fma chain
                s1 = 0
                for ib in range(8):
                    s1 += ((np.int32(xbsums[t, 16 * b + 2 * ib]) + np.int32(xbsums[t, 16 * b + 2 * ib + 1]))
                           * sgn[4 * ib] * ls[2 * ib])
                acc1[t] = fma(d, np.float32(s1), acc1[t])
    for t in range(T):
        if is_m:
            out[t, r] = fma(_DELTA, _hsum8(acc2[t]), _hsum8(acc[t]))
        else:
            out[t, r] = fma(_DELTA, acc1[t], _hsum8(acc[t]))


@njit(cache=True, inline="always")
def _iq1_tiled_row(raw, r, is_m, xqs, xd, out, g, ls, sgn, acc):
    """One weight row of IQ1_S / IQ1_M for T >= 8, as llama.cpp's tiled matmul
    (tiled_unpack_src0 for block_iq1_s / _iq1_m, tiled_run_microtile_avx2): codes 8 * grid +
    delta, per block the exact total S1 = sum of scale * code . y over the 32- (IQ1_S) or
    16-value (IQ1_M) sub-blocks; acc = fma((f16(d) * 0.125) * float(S1), y.d, acc)."""
    T, nb = xqs.shape[0], xqs.shape[1] // QK_K
    acc[:] = 0
    bb = IQ1M_BYTES if is_m else IQ1S_BYTES
    for b in range(nb):
        p, k0 = bb * b, QK_K * b
        _iq1_codes(raw, p, is_m, g, ls, sgn)
        for v in range(QK_K):
            g[v] = 8 * g[v] + sgn[v // 8]
        dw = (_iq1m_d(raw, p) if is_m else load_f16(raw, p)) * np.float32(0.125)
        for t in range(T):
            s1 = 0
            for sb in range(16):
                s = 0
                for v in range(16 * sb, 16 * sb + 16):
                    s += g[v] * np.int32(xqs[t, k0 + v])
                s1 += ls[sb] * s
            acc[t] = fma(dw * np.float32(s1), xd[t, b], acc[t])
    for t in range(T):
        out[t, r] = acc[t]


@njit(cache=True, inline="always")
def _iq1_matmul(is_m, tiled, w, xqs, xd, xbsums, out):
    T = xqs.shape[0]
    if tiled:
        for r in prange(w.shape[0]):
            _iq1_tiled_row(w[r], r, is_m, xqs, xd, out, np.empty(QK_K, np.int32), np.empty(16, np.int32),
                           np.empty(32, np.int32), np.empty(T, np.float32))
        return
    for r in prange(w.shape[0]):
        _iq1_row(w[r], r, is_m, xqs, xd, xbsums, out, np.empty(QK_K, np.int32), np.empty(QK_K, np.int32),
                 np.empty(16, np.int32), np.empty(32, np.int32), np.empty(8, np.int32), np.empty(8, np.int32),
                 np.empty((T, 8), np.float32), np.empty((T, 8), np.float32), np.empty(T, np.float32))


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq1_s_q8_k(w, xqs, xd, xbsums, out):
    """IQ1_S weights x Q8_K activations. T < 8: ggml_vec_dot_iq1_s_q8_K (AVX2): per block, 8
    int32 lanes of scale * grid . y and the scalar sum of scale * sign * bsums, each times
    d = y.d * f16(x.d) by fma; out = hsum_float_8(lanes) + 0.125 * scalar (fma). T >= 8:
    llama.cpp's tiled matmul (ggml_tiled_min_batch; see _iq1_tiled_row)."""
    _iq1_matmul(False, xqs.shape[0] >= 8, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq1_m_q8_k(w, xqs, xd, xbsums, out):
    """IQ1_M weights x Q8_K activations. T < 8: ggml_vec_dot_iq1_m_q8_K (AVX2): two sets of 8
    fma lanes (scale * grid . y, scale * delta sign . y) with d = y.d * f16(scale); out =
    hsum_float_8(first) + 0.125 * hsum_float_8(second) (fma). T >= 8: the tiled matmul."""
    _iq1_matmul(True, xqs.shape[0] >= 8, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq1_s_q8_k_bi(w, xqs, xd, xbsums, out):
    """IQ1_S, batch-invariant: ggml_vec_dot_iq1_s_q8_K's arithmetic for every T."""
    _iq1_matmul(False, False, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq1_m_q8_k_bi(w, xqs, xd, xbsums, out):
    """IQ1_M, batch-invariant: ggml_vec_dot_iq1_m_q8_K's arithmetic for every T."""
    _iq1_matmul(True, False, w, xqs, xd, xbsums, out)


@njit(cache=True, inline="always")
def _tq_matmul(is_1, w, xqs, xd, xbsums, out):
    """ggml_vec_dot_tq1_0_q8_K / _tq2_0_q8_K (AVX2): lane m of a block = sum of code * y over the
    values v with (v % 32) // 4 == m, minus bsums[2m] + bsums[2m+1]; sumf lane = fma(float(lane),
    d, sumf) (GCC contracts _mm256_add_ps(_mm256_mul_ps(..)) ); out = hsum_float_8(sumf)."""
    T, nb = xqs.shape[0], xqs.shape[1] // QK_K
    for r in prange(w.shape[0]):
        q = np.empty(QK_K, np.int32)
        acc = np.zeros((T, 8), np.float32)
        for b in range(nb):
            k0 = QK_K * b
            dw = _tq_block(w[r], b, is_1, q)
            for t in range(T):
                d = xd[t, b] * dw
                for m in range(8):
                    s = -(np.int32(xbsums[t, 16 * b + 2 * m]) + np.int32(xbsums[t, 16 * b + 2 * m + 1]))
                    for sb in range(8):
                        for j in range(32 * sb + 4 * m, 32 * sb + 4 * m + 4):
                            s += q[j] * np.int32(xqs[t, k0 + j])
                    acc[t, m] = fma(np.float32(s), d, acc[t, m])
        for t in range(T):
            out[t, r] = _hsum8(acc[t])


@njit(parallel=True, cache=True, nogil=True)
def matmul_tq1_0_q8_k(w, xqs, xd, xbsums, out):
    """TQ1_0 weights x Q8_K activations (ggml_vec_dot_tq1_0_q8_K; see _tq_matmul)."""
    _tq_matmul(True, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_tq2_0_q8_k(w, xqs, xd, xbsums, out):
    """TQ2_0 weights x Q8_K activations (ggml_vec_dot_tq2_0_q8_K; see _tq_matmul)."""
    _tq_matmul(False, w, xqs, xd, xbsums, out)
