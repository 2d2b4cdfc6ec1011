"""ggml's quantizers without an imatrix for the K-quants: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
(quantize_row_<type>_ref), byte for byte (C's float arithmetic: quant.c_float), and the scale
searches and block tails that the imatrix quantizers (quant.imatrix_quants) share.

A kernel ``quantize_<type>(x, out)`` quantizes rows in parallel. Shapes: x f32[R, K]
(C-contiguous, K a multiple of 256), out u8[R, row_bytes].
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from gguf import GGMLQuantizationType as T

from kernels_cpu.f16 import f16_to_f32
from kernels_cpu.ggml_types import TYPES
from kernels_cpu.quantize_act import nearest_int
from quant.c_float import GROUP_MAX_EPS, ONE, ZERO, as_int8, load_byte, put_fp16

# bytes per block (the type table's), constants in the kernels
Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES = (
    TYPES[t].type_size for t in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K))


# ---------------------------------------------------------------------------------------------
# K-quant helpers (ggml-quants.c): x is one group of values (a view), L its quants


@njit(cache=True, error_model="numpy")
def _signed_absmax(x):
    """(amax, max): the largest |x| and the x that has it (the first one; `ax > amax`)."""
    amax = ZERO
    vmax = ZERO
    for i in range(x.size):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            vmax = x[i]
    return amax, vmax


@njit(cache=True, error_model="numpy")
def make_qx_quants(nmax, x, weights, L, laux):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw) (Q6_K; Q4_0, Q5_0, Q3_K with an imatrix):
    weighted least-squares scale over 19 trial inverse scales -(nmax + 0.1*is)/max; L in
    0..2*nmax-1. ``weights`` f32[n] is qw, or x*x (what rmse_type 1 uses without qw).
    Returns the scale (0 for a group with max|x| < 1e-15, then L = 0)."""
    amax, vmax = _signed_absmax(x)
    if amax < GROUP_MAX_EPS:
        L[:] = 0
        return ZERO
    fnmax = np.float32(nmax)
    iscale = np.float32(-nmax) / vmax
    sumlx = ZERO
    suml2 = ZERO
    for i in range(x.size):
        q = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = q + nmax
        w = weights[i]
        fq = np.float32(q)
        sumlx += w * x[i] * fq
        suml2 += w * fq * fq
    scale = sumlx / suml2 if suml2 != ZERO else ZERO
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(fnmax + np.float32(0.1) * np.float32(step)) / vmax
        sumlx = ZERO
        suml2 = ZERO
        for i in range(x.size):
            q = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            laux[i] = q
            w = weights[i]
            fq = np.float32(q)
            sumlx += w * x[i] * fq
            suml2 += w * fq * fq
        if suml2 > ZERO and sumlx * sumlx > best * suml2:
            for i in range(x.size):
                L[i] = laux[i] + nmax
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(cache=True, error_model="numpy")
def _make_q3_quants(nmax, x, L):
    """make_q3_quants(n, nmax, x, L, do_rmse=true) (Q3_K): quants from -nmax/max, then up to 5
    passes of per-value changes that raise sumlx^2/suml2 (w = x*x); L in 0..2*nmax-1.
    Returns sumlx/suml2 (0 for a group with max|x| < 1e-15, then L = 0)."""
    amax, vmax = _signed_absmax(x)
    if amax < GROUP_MAX_EPS:
        L[:] = 0
        return ZERO
    iscale = np.float32(-nmax) / vmax
    sumlx = ZERO
    suml2 = ZERO
    for i in range(x.size):
        q = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = q
        w = x[i] * x[i]
        fq = np.float32(q)
        sumlx += w * x[i] * fq
        suml2 += w * fq * fq
    for _ in range(5):
        n_changed = 0
        for i in range(x.size):
            xi = x[i]
            w = xi * xi
            fl = np.float32(L[i])
            slx = sumlx - w * xi * fl
            if slx > ZERO:
                sl2 = suml2 - w * fl * fl
                new_l = max(-nmax, min(nmax - 1, nearest_int(xi * sl2 / slx)))
                if new_l != L[i]:
                    fn = np.float32(new_l)
                    slx += w * xi * fn
                    sl2 += w * fn * fn
                    if sl2 > ZERO and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(x.size):
        L[i] += nmax
    return sumlx / suml2 if suml2 > ZERO else ZERO


@njit(cache=True, error_model="numpy")
def make_qkx2_quants(nmax, x, weights, L, laux, rmin, rdelta, nstep, use_mad):
    """make_qkx2_quants (Q2_K, Q4_K, Q5_K): x ~ scale * L - the_min with L in 0..nmax; starts
    from the min/max grid, then tries inverse scales (rmin + rdelta*is + nmax)/(max - min),
    is = 0..nstep, each with a weighted least-squares (scale, min), keeping the lowest weighted
    error (|.| if use_mad else square). Returns (scale, the_min), the_min = -min >= 0."""
    n = x.size
    vmin = x[0]
    vmax = x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < vmin:
            vmin = x[i]
        if x[i] > vmax:
            vmax = x[i]
        sum_w += weights[i]
        sum_x += weights[i] * x[i]
    if vmin > ZERO:
        vmin = ZERO
    if vmax == vmin:
        L[:] = 0
        return ZERO, -vmin
    fnmax = np.float32(nmax)
    iscale = fnmax / (vmax - vmin)
    scale = ONE / iscale
    best_error = ZERO
    for i in range(n):
        q = max(0, min(nmax, nearest_int(iscale * (x[i] - vmin))))
        L[i] = q
        diff = scale * np.float32(q) + vmin - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best_error += weights[i] * diff
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * np.float32(step) + fnmax) / (vmax - vmin)
        sum_l = ZERO
        sum_l2 = ZERO
        sum_xl = ZERO
        for i in range(n):
            q = max(0, min(nmax, nearest_int(iscale * (x[i] - vmin))))
            laux[i] = q
            w = weights[i]
            fq = np.float32(q)
            sum_l += w * fq
            sum_l2 += w * fq * fq
            sum_xl += w * fq * x[i]
        det = sum_w * sum_l2 - sum_l * sum_l
        if det > ZERO:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            if this_min > ZERO:
                this_min = ZERO
                this_scale = sum_xl / sum_l2
            cur_error = ZERO
            for i in range(n):
                diff = this_scale * np.float32(laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                cur_error += weights[i] * diff
            if cur_error < best_error:
                L[:] = laux[:n]
                best_error = cur_error
                scale = this_scale
                vmin = this_min
    return scale, -vmin


@njit(cache=True, error_model="numpy", inline="always")
def _pack_2bit(L, qs):
    """Q2_K / Q3_K quant layout, qs u8[64]: per half c and l < 32 the byte
    L[128c+l] | L[128c+l+32] << 2 | L[128c+l+64] << 4 | L[128c+l+96] << 6."""
    for c in range(2):
        for k in range(32):
            j = 128 * c + k
            qs[32 * c + k] = L[j] | (L[j + 32] << 2) | (L[j + 64] << 4) | (L[j + 96] << 6)


# ---------------------------------------------------------------------------------------------
# K-quant super-blocks of 256 values (xb: the block's values, y: its bytes). The *_finish
# helpers are the tails that quantize_row_<t>_ref and quantize_row_<t>_impl (imatrix) share.


@njit(cache=True, error_model="numpy")
def q2_k_finish(xb, y, L):
    """Q2_K tail: with d, dmin (bytes 80-83) and scales[16] stored, redo the quants of every
    sub-block whose d * scale is not 0 (clamped to 0..3) and pack them into qs."""
    dh = f16_to_f32(load_byte(y, 80) | (load_byte(y, 81) << 8))
    dmh = f16_to_f32(load_byte(y, 82) | (load_byte(y, 83) << 8))
    for j in range(16):
        d = dh * np.float32(load_byte(y, j) & 0xF)
        if d == ZERO:
            continue
        dm = dmh * np.float32(load_byte(y, j) >> 4)
        for k in range(16):
            L[16 * j + k] = max(0, min(3, nearest_int((xb[16 * j + k] + dm) / d)))
    _pack_2bit(L, y[16:80])


@njit(cache=True, error_model="numpy")
def _q2_k_row(x, out):
    """quantize_row_q2_K_ref. Block (84 B): scales[16] (low nibble scale, high nibble min),
    qs[64] (2-bit quants), d f16, dmin f16. 16 groups of 16: make_qkx2_quants(nmax 3, w = |x|,
    -0.5, 0.1, 15 steps, absolute error); scales and mins quantized to 4 bits against the
    largest (d = max_scale/15, dmin = max_min/15); quants redone with the fp16 scales."""
    L = np.zeros(256, np.int64)
    laux = np.empty(16, np.int64)
    weights = np.empty(16, np.float32)
    scales = np.empty(16, np.float32)
    mins = np.empty(16, np.float32)
    q4scale = np.float32(15.0)
    for b in range(x.size // 256):
        xb = x[256 * b:256 * b + 256]
        y = out[Q2_K_BYTES * b:Q2_K_BYTES * (b + 1)]
        max_scale = ZERO
        max_min = ZERO
        for j in range(16):
            for k in range(16):
                weights[k] = abs(xb[16 * j + k])
            s, m = make_qkx2_quants(3, xb[16 * j:16 * j + 16], weights, L[16 * j:16 * j + 16], laux,
                                     np.float32(-0.5), np.float32(0.1), 15, True)
            scales[j] = s
            mins[j] = m
            if s > max_scale:
                max_scale = s
            if m > max_min:
                max_min = m
        if max_scale > ZERO:
            iscale = q4scale / max_scale
            for j in range(16):
                y[j] = nearest_int(iscale * scales[j]) & 0xFF
            put_fp16(y, 80, max_scale / q4scale)
        else:
            y[:16] = 0
            put_fp16(y, 80, ZERO)
        if max_min > ZERO:
            iscale = q4scale / max_min
            for j in range(16):
                y[j] = (load_byte(y, j) | (nearest_int(iscale * mins[j]) << 4)) & 0xFF
            put_fp16(y, 82, max_min / q4scale)
        else:
            put_fp16(y, 82, ZERO)
        q2_k_finish(xb, y, L)


@njit(cache=True, error_model="numpy")
def q3_k_finish(xb, y, L, scale_codes):
    """Q3_K tail: store the 6-bit scale codes (0..63, signed scale + 32) into scales[12] (low
    nibbles in bytes 0-7, high 2 bits in bytes 8-11); with d (bytes 108-109) stored, redo the
    quants of every sub-block whose d * scale is not 0 (clamped to -4..3, + 4); bit 2 of each
    quant goes to hmask, bits 0-1 to qs."""
    sc = y[96:108]
    sc[:] = 0
    for j in range(16):
        q = scale_codes[j]
        if j < 8:
            sc[j] = q & 0xF
        else:
            sc[j - 8] |= (q & 0xF) << 4
        sc[8 + j % 4] |= (q >> 4) << (2 * (j // 4))
    dh = f16_to_f32(load_byte(y, 108) | (load_byte(y, 109) << 8))
    for j in range(16):
        low = (load_byte(sc, j) & 0xF) if j < 8 else (load_byte(sc, j - 8) >> 4)
        d = dh * np.float32((low | (((load_byte(sc, 8 + j % 4) >> (2 * (j // 4))) & 3) << 4)) - 32)
        if d == ZERO:
            continue
        for k in range(16):
            L[16 * j + k] = max(-4, min(3, nearest_int(xb[16 * j + k] / d))) + 4
    y[:32] = 0
    for j in range(256):
        if L[j] > 3:
            y[j % 32] |= 1 << (j // 32)
            L[j] -= 4
    _pack_2bit(L, y[32:96])


@njit(cache=True, error_model="numpy")
def _q3_k_row(x, out):
    """quantize_row_q3_K_ref. Block (110 B): hmask[32] (bit 2 of each quant), qs[64] (bits 0-1),
    scales[12] (16 6-bit signed scales: low nibbles in bytes 0-7, high 2 bits in bytes 8-11),
    d f16. 16 groups of 16: make_q3_quants(nmax 4); scales quantized against the one of largest
    |scale| (d = 1/(-32/max_scale)); quants redone with the fp16 scales, clamped to -4..3."""
    L = np.zeros(256, np.int64)
    scales = np.empty(16, np.float32)
    codes = np.empty(16, np.int64)
    for b in range(x.size // 256):
        xb = x[256 * b:256 * b + 256]
        y = out[Q3_K_BYTES * b:Q3_K_BYTES * (b + 1)]
        max_scale = ZERO
        amax = ZERO
        for j in range(16):
            s = _make_q3_quants(4, xb[16 * j:16 * j + 16], L[16 * j:16 * j + 16])
            scales[j] = s
            if abs(s) > amax:
                amax = abs(s)
                max_scale = s
        if max_scale != ZERO:
            iscale = np.float32(-32.0) / max_scale
            for j in range(16):
                codes[j] = max(-32, min(31, as_int8(nearest_int(iscale * scales[j]) & 0xFF))) + 32
            put_fp16(y, 108, ONE / iscale)
        else:
            codes[:] = 0
            put_fp16(y, 108, ZERO)
        q3_k_finish(xb, y, L, codes)


@njit(cache=True, error_model="numpy")
def q4_k_q5_k_finish(xb, y, L, ls, lm, nbits):
    """Q4_K / Q5_K tail: pack the 6-bit scale and min codes ls[8], lm[8] into scales[12] as
    get_scale_min_k4 reads them (a code above 63 is cut to a byte as C stores it); with d and
    dmin (bytes 0-3) stored, redo the quants of every sub-block whose d * scale is not 0
    (clamped to 0..nmax) and pack them: per 64-value chunk c, qs[32c+l] = L[64c+l] |
    L[64c+l+32] << 4 (low 4 bits); Q5_K qh: bit 2c of qh[l] = bit 4 of L[64c+l], bit 2c+1 =
    bit 4 of L[64c+l+32]."""
    nmax = 15 if nbits == 4 else 31
    sc = y[4:16]
    for j in range(8):
        if j < 4:
            sc[j] = ls[j] & 0xFF
            sc[j + 4] = lm[j] & 0xFF
        else:
            sc[j + 4] = ((ls[j] & 0xF) | ((lm[j] & 0xF) << 4)) & 0xFF
            sc[j - 4] = (load_byte(sc, j - 4) | ((ls[j] >> 4) << 6)) & 0xFF
            sc[j] = (load_byte(sc, j) | ((lm[j] >> 4) << 6)) & 0xFF
    dh = f16_to_f32(load_byte(y, 0) | (load_byte(y, 1) << 8))
    dmh = f16_to_f32(load_byte(y, 2) | (load_byte(y, 3) << 8))
    for j in range(8):
        if j < 4:
            s6 = load_byte(sc, j) & 63
            m6 = load_byte(sc, j + 4) & 63
        else:
            s6 = (load_byte(sc, j + 4) & 0xF) | ((load_byte(sc, j - 4) >> 6) << 4)
            m6 = (load_byte(sc, j + 4) >> 4) | ((load_byte(sc, j) >> 6) << 4)
        d = dh * np.float32(s6)
        if d == ZERO:
            continue
        dm = dmh * np.float32(m6)
        for k in range(32):
            L[32 * j + k] = max(0, min(nmax, nearest_int((xb[32 * j + k] + dm) / d)))
    qs = y[16:] if nbits == 4 else y[48:]
    qh = y[16:48]
    if nbits == 5:
        qh[:] = 0
    for c in range(4):
        for k in range(32):
            l1 = L[64 * c + k]
            l2 = L[64 * c + k + 32]
            if nbits == 5:
                if l1 > 15:
                    l1 -= 16
                    qh[k] |= 1 << (2 * c)
                if l2 > 15:
                    l2 -= 16
                    qh[k] |= 2 << (2 * c)
            qs[32 * c + k] = (l1 | (l2 << 4)) & 0xFF


@njit(cache=True, error_model="numpy")
def _q4_k_q5_k_row(x, out, nbits):
    """quantize_row_q4_K_ref (nbits 4) / quantize_row_q5_K_ref (nbits 5).
    Q4_K block (144 B): d f16, dmin f16, scales[12], qs[128]; Q5_K (176 B): d, dmin, scales[12],
    qh[32], qs[128]. 8 groups of 32: weights av_x + |x| (av_x = sqrt(sum x^2 / 32)),
    make_qkx2_quants(nmax 15 / 31, rmin -1 / -0.5, 0.1, 20 / 15 steps, squared error); scales
    and mins quantized to 6 bits against the largest (d = max_scale/63, dmin = max_min/63);
    packed and re-quantized by q4_k_q5_k_finish."""
    nmax = 15 if nbits == 4 else 31
    rmin = np.float32(-1.0) if nbits == 4 else np.float32(-0.5)
    nstep = 20 if nbits == 4 else 15
    block_bytes = Q4_K_BYTES if nbits == 4 else Q5_K_BYTES
    L = np.zeros(256, np.int64)
    laux = np.empty(32, np.int64)
    weights = np.empty(32, np.float32)
    scales = np.empty(8, np.float32)
    mins = np.empty(8, np.float32)
    ls = np.empty(8, np.int64)
    lm = np.empty(8, np.int64)
    f63 = np.float32(63.0)
    for b in range(x.size // 256):
        xb = x[256 * b:256 * b + 256]
        y = out[block_bytes * b:block_bytes * (b + 1)]
        max_scale = ZERO
        max_min = ZERO
        for j in range(8):
            xg = xb[32 * j:32 * j + 32]
            sum_x2 = ZERO
            for k in range(32):
                sum_x2 += xg[k] * xg[k]
            av_x = np.float32(np.sqrt(sum_x2 / np.float32(32.0)))
            for k in range(32):
                weights[k] = av_x + abs(xg[k])
            s, m = make_qkx2_quants(nmax, xg, weights, L[32 * j:32 * j + 32], laux,
                                     rmin, np.float32(0.1), nstep, False)
            scales[j] = s
            mins[j] = m
            if s > max_scale:
                max_scale = s
            if m > max_min:
                max_min = m
        inv_scale = f63 / max_scale if max_scale > ZERO else ZERO
        inv_min = f63 / max_min if max_min > ZERO else ZERO
        for j in range(8):
            ls[j] = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)
            lm[j] = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
        put_fp16(y, 0, max_scale / f63)
        put_fp16(y, 2, max_min / f63)
        q4_k_q5_k_finish(xb, y, L, ls, lm, nbits)


@njit(cache=True, error_model="numpy")
def q6_k_row(x, out, qw):
    """quantize_row_q6_K_ref (qw empty) / quantize_row_q6_K_impl (qw f32[K], the row's
    imatrix weights). Block (210 B): ql[128] (low 4 bits), qh[64] (high 2 bits), scales
    int8[16], d f16. 16 groups of 16: make_qx_quants(nmax 32, rmse_type 1, weights x*x or qw);
    scales quantized against the one of largest |scale| (iscale = -128/max_scale, d = 1/iscale);
    quants redone with the fp16 scales, clamped to -32..31; an all-tiny block is 210 zero bytes.
    Per half h (128 values, ql += 64h, qh += 32h) and l < 32: ql[l] = L[l] | L[l+64] << 4,
    ql[l+32] = L[l+32] | L[l+96] << 4 (low nibbles), qh[l] = bits 4-5 of L[l], L[l+32], L[l+64],
    L[l+96] at bits 0, 2, 4, 6."""
    L = np.zeros(256, np.int64)
    laux = np.empty(16, np.int64)
    weights = np.empty(16, np.float32)
    scales = np.empty(16, np.float32)
    for b in range(x.size // 256):
        xb = x[256 * b:256 * b + 256]
        y = out[Q6_K_BYTES * b:Q6_K_BYTES * (b + 1)]
        max_scale = ZERO
        max_abs_scale = ZERO
        for j in range(16):
            xg = xb[16 * j:16 * j + 16]
            for k in range(16):
                weights[k] = qw[256 * b + 16 * j + k] if qw.size else xg[k] * xg[k]
            s = make_qx_quants(32, xg, weights, L[16 * j:16 * j + 16], laux)
            scales[j] = s
            if abs(s) > max_abs_scale:
                max_abs_scale = abs(s)
                max_scale = s
        if max_abs_scale < GROUP_MAX_EPS:
            y[:] = 0
            continue
        iscale = np.float32(-128.0) / max_scale
        dh = put_fp16(y, 208, ONE / iscale)
        for j in range(16):
            y[192 + j] = min(127, nearest_int(iscale * scales[j])) & 0xFF
        for j in range(16):
            d = dh * np.float32(as_int8(load_byte(y, 192 + j)))
            if d == ZERO:
                continue
            for k in range(16):
                L[16 * j + k] = max(-32, min(31, nearest_int(xb[16 * j + k] / d))) + 32
        for h in range(2):
            ql = y[64 * h:64 * h + 64]
            qh = y[128 + 32 * h:160 + 32 * h]
            for k in range(32):
                j = 128 * h + k
                ql[k] = (L[j] & 0xF) | ((L[j + 64] & 0xF) << 4)
                ql[k + 32] = (L[j + 32] & 0xF) | ((L[j + 96] & 0xF) << 4)
                qh[k] = ((L[j] >> 4) | ((L[j + 32] >> 4) << 2)
                         | ((L[j + 64] >> 4) << 4) | ((L[j + 96] >> 4) << 6))

# ---------------------------------------------------------------------------------------------
# per-type parallel kernels. Shapes: x f32[R, K] (C-contiguous), out u8[R, row_bytes].


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q2_k(x, out):
    for r in prange(x.shape[0]):
        _q2_k_row(x[r], out[r])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q3_k(x, out):
    for r in prange(x.shape[0]):
        _q3_k_row(x[r], out[r])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q4_k(x, out):
    for r in prange(x.shape[0]):
        _q4_k_q5_k_row(x[r], out[r], 4)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q5_k(x, out):
    for r in prange(x.shape[0]):
        _q4_k_q5_k_row(x[r], out[r], 5)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quantize_q6_k(x, out):
    no_weights = np.empty(0, np.float32)
    for r in prange(x.shape[0]):
        q6_k_row(x[r], out[r], no_weights)
