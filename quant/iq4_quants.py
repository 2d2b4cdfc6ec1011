"""ggml's IQ4_NL and IQ4_XS quantizers: float32 rows -> the bytes llama-quantize writes.

Mirrors ggml-quants.c ``quantize_iq4_nl`` and ``quantize_iq4_xs`` (both through
``quantize_row_iq4_nl_impl`` with ntry 7), what ggml_quantize_chunk calls for these types with
and without an imatrix in llama.cpp 0c1e57098 (llama-cpp-python 0.3.36). Not mirrored:
``quantize_row_iq4_nl_ref`` (ntry -1), which ggml_quantize_chunk never calls and which leaves an
all-zero block's quants uninitialised. The 16 non-linear levels are gguf-py's
``gguf.quants.IQ4_NL.kvalues`` (ggml's kvalues_iq4nl).

Per block of 32 (IQ4_NL) or super-block of 256 (IQ4_XS, 8 blocks of 32): sigma2 = 2 * sum x^2
/ n over the (super-)block; weights qw * sqrtf(sigma2 + x^2) with an imatrix, else x^2; each
32-block's scale is the best of 16 trial scales (id = (itry - 127) / max, itry -7..7, plus
max / 127) by sumqx^2 / sumq2, each value taking the nearest level (best_index_int8). IQ4_NL
stores that scale as fp16 and the levels of 1/scale * x; IQ4_XS stores d = -max_scale / 32
(fp16) and 6-bit block scales l = nearest_int(scale / d) clamped to -32..31 (+32, low 4 bits
in scales_l, high 2 in scales_h), the levels being those of x / (d * l). Float arithmetic is
C's, operation by operation (quant.c_float). Kernels ``quantize_iq4_{nl,xs}[_imatrix]`` quantize
rows in parallel; called through quant.quantize.quantize_rows.
"""
from __future__ import annotations

import numpy as np
from gguf.quants import IQ4_NL as _GGUF_IQ4_NL
from numba import njit, prange

from kernels_cpu.quantize_act import nearest_int
from quant.c_float import GROUP_MAX_EPS, ONE, ZERO, put_fp16

KVALUES = np.array(_GGUF_IQ4_NL.kvalues, np.float32)  # kvalues_iq4nl as floats (exact)
NTRY = 7  # the ntry quantize_iq4_nl / quantize_iq4_xs pass
IQ4_NL_BYTES = 2 + 16  # block_iq4_nl: d, qs[16]
IQ4_XS_BYTES = 2 + 2 + 4 + 128  # block_iq4_xs: d, scales_h, scales_l[4], qs[128]


@njit(cache=True, error_model="numpy", inline="always")
def best_index_int8(values, x):
    """best_index_int8(16, values, x): index of the level nearest x (binary search; a tie goes to
    the upper level; x <= values[0] -> 0, x >= values[15] -> 15; NaN -> 15 as in C)."""
    n = values.size
    if x <= values[0]:
        return 0
    if x >= values[n - 1]:
        return n - 1
    ml = 0
    mu = n - 1
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < values[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - values[mu - 1] < values[mu] - x else mu


@njit(cache=True, error_model="numpy")
def _iq4_impl(x, y, qw, q0, use_qw, xs, values, weight, scales, L):
    """quantize_row_iq4_nl_impl(super_block_size = x.size, 32, ..., ntry 7) on one (super-)block
    x f32[32 or 256] into y (the block's bytes: IQ4_NL when not xs, else IQ4_XS);
    qw[q0:q0 + x.size] (the imatrix entries of x) used when use_qw. weight f32[32], scales f32[8], L int64[x.size]: scratch."""
    n = x.size
    sigma2 = ZERO
    for j in range(n):
        sigma2 += x[j] * x[j]
    sigma2 *= np.float32(2.0) / np.float32(n)
    qs_at = IQ4_XS_BYTES - 128 if xs else 2
    for j in range(n // 2):
        y[qs_at + j] = 0
    nb = n // 32
    max_scale = ZERO
    amax_scale = ZERO
    for ib in range(nb):
        xb = x[32 * ib:32 * ib + 32]
        Lb = L[32 * ib:32 * ib + 32]
        if use_qw:
            for j in range(32):
                weight[j] = qw[q0 + 32 * ib + j] * np.float32(np.sqrt(sigma2 + xb[j] * xb[j]))
        else:
            for j in range(32):
                weight[j] = xb[j] * xb[j]
        amax = ZERO
        vmax = ZERO
        for j in range(32):
            ax = abs(xb[j])
            if ax > amax:
                amax = ax
                vmax = xb[j]
        if amax < GROUP_MAX_EPS:
            scales[ib] = ZERO
            continue
        d = -vmax / values[0]
        inv = ONE / d
        sumqx = ZERO
        sumq2 = ZERO
        for j in range(32):
            al = inv * xb[j]
            lv = best_index_int8(values, al)
            Lb[j] = lv
            q = values[lv]
            w = weight[j]
            sumqx += w * q * xb[j]
            sumq2 += w * q * q
        d = sumqx / sumq2 if sumq2 > ZERO else ZERO
        best = d * sumqx
        for itry in range(-NTRY, NTRY + 1):
            inv = (np.float32(itry) + values[0]) / vmax
            sumqx = ZERO
            sumq2 = ZERO
            for j in range(32):
                al = inv * xb[j]
                q = values[best_index_int8(values, al)]
                w = weight[j]
                sumqx += w * q * xb[j]
                sumq2 += w * q * q
            if sumq2 > ZERO and sumqx * sumqx > best * sumq2:
                d = sumqx / sumq2
                best = d * sumqx
        scales[ib] = d
        abs_d = abs(d)
        if abs_d > amax_scale:
            amax_scale = abs_d
            max_scale = d
    if nb > 1:
        scales_h = 0
        d = -max_scale / np.float32(32.0)
        put_fp16(y, 0, d)
        inv = ONE / d if d != ZERO else ZERO
        for ib in range(nb):
            lv = nearest_int(inv * scales[ib])
            lv = max(-32, min(31, lv))
            dl = d * np.float32(lv)
            idl = ONE / dl if dl != ZERO else ZERO
            for j in range(32):
                L[32 * ib + j] = best_index_int8(values, idl * x[32 * ib + j])
            lv += 32
            if ib % 2 == 0:
                y[4 + ib // 2] = lv & 0xF
            else:
                y[4 + ib // 2] |= (lv & 0xF) << 4
            scales_h |= (lv >> 4) << (2 * (ib % 8))
        y[2] = scales_h & 0xFF
        y[3] = (scales_h >> 8) & 0xFF
    else:
        put_fp16(y, 0, scales[0])
        inv = ONE / scales[0] if scales[0] != ZERO else ZERO
        for j in range(n):
            L[j] = best_index_int8(values, inv * x[j])
    for i in range(n // 32):
        for j in range(16):
            y[qs_at + 16 * i + j] = (L[32 * i + j] | (L[32 * i + 16 + j] << 4)) & 0xFF


@njit(cache=True, error_model="numpy")
def _iq4_row(x, out, qw, use_qw, xs):
    """One row: quantize_iq4_xs (xs) or quantize_iq4_nl of x f32[K] into out u8[row bytes]."""
    n = 256 if xs else 32
    nbytes = IQ4_XS_BYTES if xs else IQ4_NL_BYTES
    weight = np.empty(32, np.float32)
    scales = np.empty(8, np.float32)
    L = np.zeros(n, np.int64)
    for b in range(x.size // n):
        _iq4_impl(x[n * b:n * b + n], out[nbytes * b:nbytes * (b + 1)], qw, n * b, use_qw, xs, KVALUES,
                  weight, scales, L)


# per-type parallel kernels. Shapes: x f32[R, K] (C-contiguous), out u8[R, row_bytes], qw f32[K].


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_iq4_nl(x, out):
    qw = np.empty(0, np.float32)
    for r in prange(x.shape[0]):
        _iq4_row(x[r], out[r], qw, False, False)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_iq4_xs(x, out):
    qw = np.empty(0, np.float32)
    for r in prange(x.shape[0]):
        _iq4_row(x[r], out[r], qw, False, True)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_iq4_nl_imatrix(x, out, qw):
    for r in prange(x.shape[0]):
        _iq4_row(x[r], out[r], qw, True, False)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_iq4_xs_imatrix(x, out, qw):
    for r in prange(x.shape[0]):
        _iq4_row(x[r], out[r], qw, True, True)
