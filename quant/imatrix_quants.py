"""ggml's quantizers weighted by an importance matrix (llama-quantize --imatrix).

Mirrors ggml-quants.c ``quantize_row_<type>_impl`` with ``quant_weights != NULL``, the path of
ggml_quantize_chunk(type, x, dst, 0, R, K, imatrix) in llama.cpp 0c1e57098 (llama-cpp-python
0.3.36), for Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K. The float arithmetic is
written operation by operation in C's order (quant.c_float); the block tails and scale searches
are those of quant.legacy_quants and quant.k_quants.
``qw`` is one float32 weight per input column (the same K weights for every row); the
quantizers weight each value by ``qw * sqrt(sigma2 + x*x)`` (sigma2 = mean x*x over the row for
the 32-value types, over the super-block (Q2_K) or twice that (Q3_K, Q4_K, Q5_K)), except Q6_K,
which uses qw as is. A kernel ``quantize_<type>_imatrix(x, out, qw)`` quantizes rows in
parallel; called through quant.quantize.quantize_rows(type, x, quant_weights).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels_cpu.quantize_act import nearest_int
from quant.c_float import GROUP_MAX_EPS, ONE, ZERO, put_fp16
from quant.k_quants import (Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, make_qkx2_quants, make_qx_quants,
                            q2_k_finish, q3_k_finish, q4_k_q5_k_finish, q6_k_row)
from quant.legacy_quants import Q4_0_BYTES, Q4_1_BYTES, Q5_0_BYTES, Q5_1_BYTES, pack_32

# make_qkx3_quants(..., rmin -0.9, rdelta 0.05, nstep 36, use_mad false) as the _impl paths call
# it: with weights given it is make_qkx2_quants (max <= min and max == min agree, min <= 0)
_RMIN = np.float32(-0.9)
_RDELTA = np.float32(0.05)
_NSTEP = 36


@njit(cache=True, error_model="numpy", inline="always")
def _c_max(a, b):
    """C's MAX(a, b) = a > b ? a : b (a NaN b is picked as C picks it)."""
    return a if a > b else b


@njit(cache=True, error_model="numpy")
def _make_qp_quants(nmax, x, L, weights):
    """make_qp_quants(n, nmax, x, L, quant_weights): quantize positive x (the sub-block scales or
    mins of a super-block) to L in 0..nmax, L uint8 as C stores it (a negative level wraps),
    choosing the scale among 9 trials (0.1*is + nmax)/max by weighted squared error, then up
    to 5 passes of per-value changes raising sumlx^2/suml2. Returns sumlx/suml2 (0 if
    suml2 <= 0; 0 and L = 0 when max x < 1e-15)."""
    n = x.size
    vmax = ZERO
    for i in range(n):
        vmax = _c_max(vmax, x[i])
    if vmax < GROUP_MAX_EPS:
        L[:] = 0
        return ZERO
    fnmax = np.float32(nmax)
    iscale = fnmax / vmax
    for i in range(n):
        L[i] = nearest_int(iscale * x[i]) & 0xFF
    scale = ONE / iscale
    best_mse = ZERO
    for i in range(n):
        diff = x[i] - scale * np.float32(L[i])
        best_mse += weights[i] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (np.float32(0.1) * np.float32(step) + fnmax) / vmax
        scale_is = ONE / iscale_is
        mse = ZERO
        for i in range(n):
            q = min(nmax, nearest_int(iscale_is * x[i]))
            diff = x[i] - scale_is * np.float32(q)
            mse += weights[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = ZERO
    suml2 = ZERO
    for i in range(n):
        q = min(nmax, nearest_int(iscale * x[i]))
        L[i] = q & 0xFF
        fq = np.float32(q)
        sumlx += weights[i] * x[i] * fq
        suml2 += weights[i] * fq * fq
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = weights[i]
            fl = np.float32(L[i])
            slx = sumlx - w * x[i] * fl
            sl2 = suml2 - w * fl * fl
            if slx > ZERO and sl2 > ZERO:
                new_l = min(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != L[i]:
                    fn = np.float32(new_l)
                    slx += w * x[i] * fn
                    sl2 += w * fn * fn
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > ZERO else ZERO


@njit(cache=True, error_model="numpy", inline="always")
def _sum_squares(x):
    """Sequential float32 sum of x*x."""
    s = ZERO
    for i in range(x.size):
        s += x[i] * x[i]
    return s


@njit(cache=True, error_model="numpy", inline="always")
def _fill_weights(weights, qw, xg, sigma2):
    """weights[l] = qw[l] * sqrtf(sigma2 + xg[l]*xg[l]); returns their sequential sum."""
    total = ZERO
    for k in range(xg.size):
        weights[k] = qw[k] * np.float32(np.sqrt(sigma2 + xg[k] * xg[k]))
        total += weights[k]
    return total


@njit(cache=True, error_model="numpy")
def _q4_0_q5_0_row_w(x, out, qw, nbits):
    """quantize_row_q4_0_impl / quantize_row_q5_0_impl: per block of 32, d =
    make_qx_quants(32, 8 (16), x, L, 1, weights) stored as fp16, L (0..15 / 0..31) packed as is
    (not re-quantized with the fp16 d); sigma2 = sum x^2 / K over the whole row."""
    block_bytes = Q4_0_BYTES if nbits == 4 else Q5_0_BYTES
    nmax = 8 if nbits == 4 else 16
    sigma2 = _sum_squares(x) / np.float32(x.size)
    weights = np.empty(32, np.float32)
    L = np.empty(32, np.int64)
    laux = np.empty(32, np.int64)
    for b in range(x.size // 32):
        xb = x[32 * b:32 * b + 32]
        y = out[block_bytes * b:block_bytes * (b + 1)]
        _fill_weights(weights, qw[32 * b:32 * b + 32], xb, sigma2)
        d = make_qx_quants(nmax, xb, weights, L, laux)
        put_fp16(y, 0, d)
        pack_32(L, y, nbits)


@njit(cache=True, error_model="numpy")
def _q4_1_q5_1_row_w(x, out, qw, nbits):
    """quantize_row_q4_1_impl / quantize_row_q5_1_impl: per block of 32, (d, min) =
    make_qkx3_quants(32, 15 (31), x, weights, L, -0.9, 0.05, 36); stored d = fp16(d),
    m = fp16(-the_min); L packed as is; sigma2 = sum x^2 / K over the whole row."""
    block_bytes = Q4_1_BYTES if nbits == 4 else Q5_1_BYTES
    nmax = 15 if nbits == 4 else 31
    sigma2 = _sum_squares(x) / np.float32(x.size)
    weights = np.empty(32, np.float32)
    L = np.empty(32, np.int64)
    laux = np.empty(32, np.int64)
    for b in range(x.size // 32):
        xb = x[32 * b:32 * b + 32]
        y = out[block_bytes * b:block_bytes * (b + 1)]
        _fill_weights(weights, qw[32 * b:32 * b + 32], xb, sigma2)
        d, the_min = make_qkx2_quants(nmax, xb, weights, L, laux, _RMIN, _RDELTA, _NSTEP, False)
        put_fp16(y, 0, d)
        put_fp16(y, 2, -the_min)
        pack_32(L, y, nbits)


@njit(cache=True, error_model="numpy")
def _q2_k_row_w(x, out, qw):
    """quantize_row_q2_K_impl: 16 groups of 16, sigma2 = sum x^2 / 256 over the super-block,
    make_qkx3_quants(16, 3, ..., -0.9, 0.05, 36, squared error); d = make_qp_quants(16, 15,
    scales, sw), dmin = make_qp_quants(16, 15, mins, sw) (sw = the groups' weight sums);
    scales[j] = Ls | Lm << 4; quants redone with the fp16 d, dmin (q2_k_finish)."""
    L = np.zeros(256, np.int64)
    laux = np.empty(16, np.int64)
    weights = np.empty(16, np.float32)
    scales = np.empty(16, np.float32)
    mins = np.empty(16, np.float32)
    sw = np.empty(16, np.float32)
    ls = np.empty(16, np.int64)
    lm = np.empty(16, np.int64)
    for b in range(x.size // 256):
        xb = x[256 * b:256 * b + 256]
        y = out[Q2_K_BYTES * b:Q2_K_BYTES * (b + 1)]
        sigma2 = _sum_squares(xb) / np.float32(256.0)
        for j in range(16):
            sw[j] = _fill_weights(weights, qw[256 * b + 16 * j:256 * b + 16 * j + 16], xb[16 * j:16 * j + 16], sigma2)
            scales[j], mins[j] = make_qkx2_quants(3, xb[16 * j:16 * j + 16], weights, L[16 * j:16 * j + 16],
                                                   laux, _RMIN, _RDELTA, _NSTEP, False)
        dm = _make_qp_quants(15, scales, ls, sw)
        mm = _make_qp_quants(15, mins, lm, sw)
        put_fp16(y, 80, dm)
        put_fp16(y, 82, mm)
        for j in range(16):
            y[j] = (ls[j] | (lm[j] << 4)) & 0xFF
        q2_k_finish(xb, y, L)


@njit(cache=True, error_model="numpy")
def _q3_k_row_w(x, out, qw):
    """quantize_row_q3_K_impl: 16 groups of 16, sigma2 = 2 * sum x^2 / 256 over the
    super-block, scale_j = make_qx_quants(16, 4, x, L, 1, weights); the 16 scales quantized by
    make_qx_quants(16, 32, scales, Ls, 1, sw) (Ls = the 6-bit codes, d its scale, stored
    fp16); quants redone with the fp16 d (q3_k_finish)."""
    L = np.zeros(256, np.int64)
    laux = np.empty(16, np.int64)
    weights = np.empty(16, np.float32)
    scales = np.empty(16, np.float32)
    sw = np.empty(16, np.float32)
    codes = np.empty(16, np.int64)
    for b in range(x.size // 256):
        xb = x[256 * b:256 * b + 256]
        y = out[Q3_K_BYTES * b:Q3_K_BYTES * (b + 1)]
        sigma2 = np.float32(2.0) * _sum_squares(xb) / np.float32(256.0)
        for j in range(16):
            sw[j] = _fill_weights(weights, qw[256 * b + 16 * j:256 * b + 16 * j + 16], xb[16 * j:16 * j + 16], sigma2)
            scales[j] = make_qx_quants(4, xb[16 * j:16 * j + 16], weights, L[16 * j:16 * j + 16], laux)
        d_block = make_qx_quants(32, scales, sw, codes, laux)
        put_fp16(y, 108, d_block)
        q3_k_finish(xb, y, L, codes)


@njit(cache=True, error_model="numpy")
def _q4_k_q5_k_row_w(x, out, qw, nbits):
    """quantize_row_q4_K_impl / quantize_row_q5_K_impl: 8 groups of 32, sigma2 = 2 * sum x^2 /
    256 over the super-block, make_qkx3_quants(32, 15 (31), ..., -0.9, 0.05, 36); d and dmin =
    make_qp_quants(8, 63, scales | mins, sw) (Q5_K cuts the codes to 63, Q4_K stores them as
    they are); packed and re-quantized by q4_k_q5_k_finish."""
    nmax = 15 if nbits == 4 else 31
    block_bytes = Q4_K_BYTES if nbits == 4 else Q5_K_BYTES
    L = np.zeros(256, np.int64)
    laux = np.empty(32, np.int64)
    weights = np.empty(32, np.float32)
    scales = np.empty(8, np.float32)
    mins = np.empty(8, np.float32)
    sw = np.empty(8, np.float32)
    ls = np.empty(8, np.int64)
    lm = np.empty(8, np.int64)
    for b in range(x.size // 256):
        xb = x[256 * b:256 * b + 256]
        y = out[block_bytes * b:block_bytes * (b + 1)]
        sigma2 = np.float32(2.0) * _sum_squares(xb) / np.float32(256.0)
        for j in range(8):
            sw[j] = _fill_weights(weights, qw[256 * b + 32 * j:256 * b + 32 * j + 32], xb[32 * j:32 * j + 32], sigma2)
            scales[j], mins[j] = make_qkx2_quants(nmax, xb[32 * j:32 * j + 32], weights, L[32 * j:32 * j + 32],
                                                   laux, _RMIN, _RDELTA, _NSTEP, False)
        d_block = _make_qp_quants(63, scales, ls, sw)
        m_block = _make_qp_quants(63, mins, lm, sw)
        if nbits == 5:
            for j in range(8):
                ls[j] = min(63, ls[j])
                lm[j] = min(63, lm[j])
        put_fp16(y, 0, d_block)
        put_fp16(y, 2, m_block)
        q4_k_q5_k_finish(xb, y, L, ls, lm, nbits)


# per-type parallel kernels. Shapes: x f32[R, K] (C-contiguous), out u8[R, row_bytes], qw f32[K].


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q4_0_imatrix(x, out, qw):
    for r in prange(x.shape[0]):
        _q4_0_q5_0_row_w(x[r], out[r], qw, 4)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q5_0_imatrix(x, out, qw):
    for r in prange(x.shape[0]):
        _q4_0_q5_0_row_w(x[r], out[r], qw, 5)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q4_1_imatrix(x, out, qw):
    for r in prange(x.shape[0]):
        _q4_1_q5_1_row_w(x[r], out[r], qw, 4)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q5_1_imatrix(x, out, qw):
    for r in prange(x.shape[0]):
        _q4_1_q5_1_row_w(x[r], out[r], qw, 5)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q2_k_imatrix(x, out, qw):
    for r in prange(x.shape[0]):
        _q2_k_row_w(x[r], out[r], qw)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q3_k_imatrix(x, out, qw):
    for r in prange(x.shape[0]):
        _q3_k_row_w(x[r], out[r], qw)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q4_k_imatrix(x, out, qw):
    for r in prange(x.shape[0]):
        _q4_k_q5_k_row_w(x[r], out[r], qw, 4)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q5_k_imatrix(x, out, qw):
    for r in prange(x.shape[0]):
        _q4_k_q5_k_row_w(x[r], out[r], qw, 5)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q6_k_imatrix(x, out, qw):
    for r in prange(x.shape[0]):
        q6_k_row(x[r], out[r], qw)
