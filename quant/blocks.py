"""GGML block quantizers: float32 rows -> the exact bytes llama-quantize writes.

``quantize_rows(ggml_type, x, quant_weights=None)`` mirrors ggml.c ``ggml_quantize_chunk``; with
an imatrix (quant_weights) the weighted ``quantize_row_<type>_impl`` paths are in
quant/blocks_imatrix.py, which shares this module's helpers. Without one (``imatrix=NULL``):
ggml-quants.c ``quantize_row_<type>_ref`` for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K,
Q5_K and Q6_K, ``ggml_fp32_to_fp16_row`` (F16), ``ggml_fp32_to_bf16_row_ref`` (BF16) and a copy
(F32), as built in ggml-org/llama.cpp@0c1e57098 (llama-cpp-python 0.3.36, the build that made
the goldens). ggml-quants.c is compiled there for baseline x86-64 (SSE2, no FMA), so every C float
expression is evaluated in float32, one rounded operation at a time, left to right; the code below
writes each operation in the same order, and numba (no fastmath) neither contracts nor reorders
float arithmetic. The details the bytes depend on:

* ``nearest_int`` is ggml's bit trick (add 1.5 * 2**23, keep the mantissa): ties to even, and it
  wraps instead of saturating for |v| >= 2**22, as in C (the K-quants clamp after it).
* C's float -> int8_t / uint8_t casts compile to cvttss2si / cvttps2dq: truncation toward zero;
  NaN, Inf and |v| >= 2**31 give 0x80000000, whose low byte is 0 (``_c_byte``).
* Stores into uint8_t / int8_t fields wrap; MIN / MAX are C's ternaries, so a NaN operand is
  picked exactly as in C.
* fp16 fields round to nearest even (overflow -> Inf, subnormals kept); NaN -> 0x7E00 | sign as
  ggml_compute_fp32_to_fp16. The K-quants re-quantize with the fp16-rounded scales, and a
  sub-block whose rounded scale is 0 keeps the quants of the scale search.

Non-finite input goes through the same arithmetic: no error, no crash, and the bytes are those
ggml's code produces. Each type has its own kernel (compiled on first use, cached on disk) that
quantizes rows in parallel; blocks never span rows and every algorithm is block-local, so the
split changes no byte.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from numba import njit, prange

from kernels_cpu.f16 import f16_to_f32, f32_to_f16
from kernels_cpu.quantize_act import nearest_int
from kernels_cpu.simd import bits_from_f32

T = GGMLQuantizationType

_ZERO = np.float32(0.0)
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)
_FLT_MAX = np.float32(np.finfo(np.float32).max)
_TWO_POW_23 = np.float32(2.0**23)
_TWO_POW_31 = np.float32(2.0**31)
_GROUP_MAX_EPS = np.float32(1e-15)  # ggml-quants.c GROUP_MAX_EPS


class QuantizeError(ValueError):
    """Input that cannot be quantized: unsupported type, wrong dtype/shape, partial blocks."""


# ---------------------------------------------------------------------------------------------
# C conversions


@njit(cache=True, error_model="numpy", inline="always")
def _c_byte(v):
    """Low byte (0..255) of C's float32 -> int8_t/uint8_t cast on x86-64: truncation toward
    zero; NaN, Inf and |v| >= 2**31 convert to 0x80000000, whose low byte is 0."""
    if abs(v) < _TWO_POW_31:  # False for NaN
        return np.int64(np.int32(v)) & 0xFF
    return 0


@njit(cache=True, error_model="numpy", inline="always")
def _byte(buf, i):
    """buf[i] of a uint8 array as int64 (keeps numba's integer arithmetic signed)."""
    return np.int64(buf[i])


@njit(cache=True, error_model="numpy", inline="always")
def _as_int8(byte):
    """Byte 0..255 -> the int8_t it holds (-128..127)."""
    return ((byte + 128) & 0xFF) - 128


@njit(cache=True, error_model="numpy", inline="always")
def _roundf(v):
    """C ``roundf`` on float32: nearest integer, halves away from zero; NaN and Inf unchanged."""
    if not abs(v) < _TWO_POW_23:  # already integral, or NaN / Inf
        return v
    t = np.float32(np.int32(v))
    if abs(v - t) >= _HALF:  # v - t is exact
        t = t + (_ONE if v > _ZERO else -_ONE)
    return t


@njit(cache=True, error_model="numpy", inline="always")
def _fp16_bits(v):
    """ggml_compute_fp32_to_fp16: binary16 bits of float32 ``v`` (RNE), NaN -> 0x7E00 | sign."""
    if v != v:
        return np.int64(0x7E00) | ((np.int64(bits_from_f32(v)) >> 16) & 0x8000)
    return np.int64(f32_to_f16(v))


@njit(cache=True, error_model="numpy", inline="always")
def _put_fp16(out, o, v):
    """Store fp16(v) little-endian at out[o:o+2]; return its value as float32
    (GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v)), what the K-quants re-quantize with)."""
    h = _fp16_bits(v)
    out[o] = h & 0xFF
    out[o + 1] = h >> 8
    return f16_to_f32(h)


@njit(cache=True, error_model="numpy", inline="always")
def _bf16_bits(v):
    """ggml_compute_fp32_to_bf16: round to nearest even on the bits; NaN -> (u >> 16) | 64."""
    u = np.int64(bits_from_f32(v))
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return (u >> 16) | 64
    return (u + (0x7FFF + ((u >> 16) & 1))) >> 16


# ---------------------------------------------------------------------------------------------
# F16, BF16 and the 32-value blocks (one fp16 scale d first in every block)


@njit(cache=True, error_model="numpy")
def _f16_row(x, out):
    """ggml_fp32_to_fp16_row. Shapes: x f32[K] -> out u8[2K] (little-endian binary16)."""
    for j in range(x.size):
        h = _fp16_bits(x[j])
        out[2 * j] = h & 0xFF
        out[2 * j + 1] = h >> 8


@njit(cache=True, error_model="numpy")
def _bf16_row(x, out):
    """ggml_fp32_to_bf16_row_ref. Shapes: x f32[K] -> out u8[2K] (little-endian bfloat16)."""
    for j in range(x.size):
        h = _bf16_bits(x[j])
        out[2 * j] = h & 0xFF
        out[2 * j + 1] = h >> 8


@njit(cache=True, error_model="numpy")
def _q8_0_row(x, out):
    """quantize_row_q8_0_ref. Block (34 B): d f16, qs int8[32].
    amax = max|x|; d = amax / 127; id = 1/d (0 if d == 0); qs = roundf(x * id)."""
    for b in range(x.size // 32):
        xb = x[32 * b:32 * b + 32]
        y = out[34 * b:34 * b + 34]
        amax = _ZERO
        for j in range(32):
            v = abs(xb[j])
            amax = amax if amax > v else v  # MAX(amax, fabsf(v))
        d = amax / np.float32(127.0)
        inv = _ONE / d if d != _ZERO else _ZERO
        _put_fp16(y, 0, d)
        for j in range(32):
            y[2 + j] = _c_byte(_roundf(xb[j] * inv))


@njit(cache=True, error_model="numpy", inline="always")
def _pack_32(q, y, nbits):
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
    q = MIN(15 (31), (int8_t)(x * id + 8.5 (16.5))), packed by _pack_32."""
    half_levels = 1 << (nbits - 1)
    qmax = 2 * half_levels - 1
    divisor = np.float32(-half_levels)
    offset = np.float32(half_levels) + _HALF
    block_bytes = 18 if nbits == 4 else 22
    q = np.empty(32, np.int64)
    for b in range(x.size // 32):
        xb = x[32 * b:32 * b + 32]
        y = out[block_bytes * b:block_bytes * (b + 1)]
        amax = _ZERO
        vmax = _ZERO
        for j in range(32):
            if amax < abs(xb[j]):
                amax = abs(xb[j])
                vmax = xb[j]
        d = vmax / divisor
        inv = _ONE / d if d != _ZERO else _ZERO
        _put_fp16(y, 0, d)
        for j in range(32):
            q[j] = min(qmax, _as_int8(_c_byte(xb[j] * inv + offset))) & 0xFF
        _pack_32(q, y, nbits)


@njit(cache=True, error_model="numpy")
def _q4_1_q5_1_row(x, out, nbits):
    """quantize_row_q4_1_ref (nbits 4) / quantize_row_q5_1_ref (nbits 5).
    Q4_1 block (20 B): d f16, m f16, qs[16]; Q5_1 block (24 B): d, m, qh u32, qs[16].
    d = (max - min) / 15 (31); m = fp16(min); id = 1/d (0 if d == 0);
    Q4_1: q = MIN(15, (int8_t)((x - min) * id + 0.5)); Q5_1: q = (uint8_t)((x - min) * id + 0.5);
    packed by _pack_32. Quants use the float32 min and id, not the fp16 ones."""
    levels = np.float32((1 << nbits) - 1)
    block_bytes = 20 if nbits == 4 else 24
    q = np.empty(32, np.int64)
    for b in range(x.size // 32):
        xb = x[32 * b:32 * b + 32]
        y = out[block_bytes * b:block_bytes * (b + 1)]
        vmin = _FLT_MAX
        vmax = -_FLT_MAX
        for j in range(32):
            if xb[j] < vmin:
                vmin = xb[j]
            if xb[j] > vmax:
                vmax = xb[j]
        d = (vmax - vmin) / levels
        inv = _ONE / d if d != _ZERO else _ZERO
        _put_fp16(y, 0, d)
        _put_fp16(y, 2, vmin)
        for j in range(32):
            q[j] = _c_byte((xb[j] - vmin) * inv + _HALF)
            if nbits == 4:
                q[j] = min(15, _as_int8(q[j])) & 0xFF
        _pack_32(q, y, nbits)


# ---------------------------------------------------------------------------------------------
# K-quant helpers (ggml-quants.c): x is one group of values (a view), L its quants


@njit(cache=True, error_model="numpy")
def _signed_absmax(x):
    """(amax, max): the largest |x| and the x that has it (the first one; `ax > amax`)."""
    amax = _ZERO
    vmax = _ZERO
    for i in range(x.size):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            vmax = x[i]
    return amax, vmax


@njit(cache=True, error_model="numpy")
def _make_qx_quants(nmax, x, weights, L, laux):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw) (Q6_K; Q4_0, Q5_0, Q3_K with an imatrix):
    weighted least-squares scale over 19 trial inverse scales -(nmax + 0.1*is)/max; L in
    0..2*nmax-1. ``weights`` f32[n] is qw, or x*x (what rmse_type 1 uses without qw).
    Returns the scale (0 for a group with max|x| < 1e-15, then L = 0)."""
    amax, vmax = _signed_absmax(x)
    if amax < _GROUP_MAX_EPS:
        L[:] = 0
        return _ZERO
    fnmax = np.float32(nmax)
    iscale = np.float32(-nmax) / vmax
    sumlx = _ZERO
    suml2 = _ZERO
    for i in range(x.size):
        q = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = q + nmax
        w = weights[i]
        fq = np.float32(q)
        sumlx += w * x[i] * fq
        suml2 += w * fq * fq
    scale = sumlx / suml2 if suml2 != _ZERO else _ZERO
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(fnmax + np.float32(0.1) * np.float32(step)) / vmax
        sumlx = _ZERO
        suml2 = _ZERO
        for i in range(x.size):
            q = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            laux[i] = q
            w = weights[i]
            fq = np.float32(q)
            sumlx += w * x[i] * fq
            suml2 += w * fq * fq
        if suml2 > _ZERO and sumlx * sumlx > best * suml2:
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
    if amax < _GROUP_MAX_EPS:
        L[:] = 0
        return _ZERO
    iscale = np.float32(-nmax) / vmax
    sumlx = _ZERO
    suml2 = _ZERO
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
            if slx > _ZERO:
                sl2 = suml2 - w * fl * fl
                new_l = max(-nmax, min(nmax - 1, nearest_int(xi * sl2 / slx)))
                if new_l != L[i]:
                    fn = np.float32(new_l)
                    slx += w * xi * fn
                    sl2 += w * fn * fn
                    if sl2 > _ZERO and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(x.size):
        L[i] += nmax
    return sumlx / suml2 if suml2 > _ZERO else _ZERO


@njit(cache=True, error_model="numpy")
def _make_qkx2_quants(nmax, x, weights, L, laux, rmin, rdelta, nstep, use_mad):
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
    if vmin > _ZERO:
        vmin = _ZERO
    if vmax == vmin:
        L[:] = 0
        return _ZERO, -vmin
    fnmax = np.float32(nmax)
    iscale = fnmax / (vmax - vmin)
    scale = _ONE / iscale
    best_error = _ZERO
    for i in range(n):
        q = max(0, min(nmax, nearest_int(iscale * (x[i] - vmin))))
        L[i] = q
        diff = scale * np.float32(q) + vmin - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best_error += weights[i] * diff
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * np.float32(step) + fnmax) / (vmax - vmin)
        sum_l = _ZERO
        sum_l2 = _ZERO
        sum_xl = _ZERO
        for i in range(n):
            q = max(0, min(nmax, nearest_int(iscale * (x[i] - vmin))))
            laux[i] = q
            w = weights[i]
            fq = np.float32(q)
            sum_l += w * fq
            sum_l2 += w * fq * fq
            sum_xl += w * fq * x[i]
        det = sum_w * sum_l2 - sum_l * sum_l
        if det > _ZERO:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            if this_min > _ZERO:
                this_min = _ZERO
                this_scale = sum_xl / sum_l2
            cur_error = _ZERO
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
def _q2_k_finish(xb, y, L):
    """Q2_K tail: with d, dmin (bytes 80-83) and scales[16] stored, redo the quants of every
    sub-block whose d * scale is not 0 (clamped to 0..3) and pack them into qs."""
    dh = f16_to_f32(_byte(y, 80) | (_byte(y, 81) << 8))
    dmh = f16_to_f32(_byte(y, 82) | (_byte(y, 83) << 8))
    for j in range(16):
        d = dh * np.float32(_byte(y, j) & 0xF)
        if d == _ZERO:
            continue
        dm = dmh * np.float32(_byte(y, j) >> 4)
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
        y = out[84 * b:84 * b + 84]
        max_scale = _ZERO
        max_min = _ZERO
        for j in range(16):
            for k in range(16):
                weights[k] = abs(xb[16 * j + k])
            s, m = _make_qkx2_quants(3, xb[16 * j:16 * j + 16], weights, L[16 * j:16 * j + 16], laux,
                                     np.float32(-0.5), np.float32(0.1), 15, True)
            scales[j] = s
            mins[j] = m
            if s > max_scale:
                max_scale = s
            if m > max_min:
                max_min = m
        if max_scale > _ZERO:
            iscale = q4scale / max_scale
            for j in range(16):
                y[j] = nearest_int(iscale * scales[j]) & 0xFF
            _put_fp16(y, 80, max_scale / q4scale)
        else:
            y[:16] = 0
            _put_fp16(y, 80, _ZERO)
        if max_min > _ZERO:
            iscale = q4scale / max_min
            for j in range(16):
                y[j] = (_byte(y, j) | (nearest_int(iscale * mins[j]) << 4)) & 0xFF
            _put_fp16(y, 82, max_min / q4scale)
        else:
            _put_fp16(y, 82, _ZERO)
        _q2_k_finish(xb, y, L)


@njit(cache=True, error_model="numpy")
def _q3_k_finish(xb, y, L, scale_codes):
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
    dh = f16_to_f32(_byte(y, 108) | (_byte(y, 109) << 8))
    for j in range(16):
        low = (_byte(sc, j) & 0xF) if j < 8 else (_byte(sc, j - 8) >> 4)
        d = dh * np.float32((low | (((_byte(sc, 8 + j % 4) >> (2 * (j // 4))) & 3) << 4)) - 32)
        if d == _ZERO:
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
        y = out[110 * b:110 * b + 110]
        max_scale = _ZERO
        amax = _ZERO
        for j in range(16):
            s = _make_q3_quants(4, xb[16 * j:16 * j + 16], L[16 * j:16 * j + 16])
            scales[j] = s
            if abs(s) > amax:
                amax = abs(s)
                max_scale = s
        if max_scale != _ZERO:
            iscale = np.float32(-32.0) / max_scale
            for j in range(16):
                codes[j] = max(-32, min(31, _as_int8(nearest_int(iscale * scales[j]) & 0xFF))) + 32
            _put_fp16(y, 108, _ONE / iscale)
        else:
            codes[:] = 0
            _put_fp16(y, 108, _ZERO)
        _q3_k_finish(xb, y, L, codes)


@njit(cache=True, error_model="numpy")
def _q4_k_q5_k_finish(xb, y, L, ls, lm, nbits):
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
            sc[j - 4] = (_byte(sc, j - 4) | ((ls[j] >> 4) << 6)) & 0xFF
            sc[j] = (_byte(sc, j) | ((lm[j] >> 4) << 6)) & 0xFF
    dh = f16_to_f32(_byte(y, 0) | (_byte(y, 1) << 8))
    dmh = f16_to_f32(_byte(y, 2) | (_byte(y, 3) << 8))
    for j in range(8):
        if j < 4:
            s6 = _byte(sc, j) & 63
            m6 = _byte(sc, j + 4) & 63
        else:
            s6 = (_byte(sc, j + 4) & 0xF) | ((_byte(sc, j - 4) >> 6) << 4)
            m6 = (_byte(sc, j + 4) >> 4) | ((_byte(sc, j) >> 6) << 4)
        d = dh * np.float32(s6)
        if d == _ZERO:
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
    packed and re-quantized by _q4_k_q5_k_finish."""
    nmax = 15 if nbits == 4 else 31
    rmin = np.float32(-1.0) if nbits == 4 else np.float32(-0.5)
    nstep = 20 if nbits == 4 else 15
    block_bytes = 144 if nbits == 4 else 176
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
        max_scale = _ZERO
        max_min = _ZERO
        for j in range(8):
            xg = xb[32 * j:32 * j + 32]
            sum_x2 = _ZERO
            for k in range(32):
                sum_x2 += xg[k] * xg[k]
            av_x = np.float32(np.sqrt(sum_x2 / np.float32(32.0)))
            for k in range(32):
                weights[k] = av_x + abs(xg[k])
            s, m = _make_qkx2_quants(nmax, xg, weights, L[32 * j:32 * j + 32], laux,
                                     rmin, np.float32(0.1), nstep, False)
            scales[j] = s
            mins[j] = m
            if s > max_scale:
                max_scale = s
            if m > max_min:
                max_min = m
        inv_scale = f63 / max_scale if max_scale > _ZERO else _ZERO
        inv_min = f63 / max_min if max_min > _ZERO else _ZERO
        for j in range(8):
            ls[j] = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)
            lm[j] = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
        _put_fp16(y, 0, max_scale / f63)
        _put_fp16(y, 2, max_min / f63)
        _q4_k_q5_k_finish(xb, y, L, ls, lm, nbits)


@njit(cache=True, error_model="numpy")
def _q6_k_row(x, out, qw):
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
        y = out[210 * b:210 * b + 210]
        max_scale = _ZERO
        max_abs_scale = _ZERO
        for j in range(16):
            xg = xb[16 * j:16 * j + 16]
            for k in range(16):
                weights[k] = qw[256 * b + 16 * j + k] if qw.size else xg[k] * xg[k]
            s = _make_qx_quants(32, xg, weights, L[16 * j:16 * j + 16], laux)
            scales[j] = s
            if abs(s) > max_abs_scale:
                max_abs_scale = abs(s)
                max_scale = s
        if max_abs_scale < _GROUP_MAX_EPS:
            y[:] = 0
            continue
        iscale = np.float32(-128.0) / max_scale
        dh = _put_fp16(y, 208, _ONE / iscale)
        for j in range(16):
            y[192 + j] = min(127, nearest_int(iscale * scales[j])) & 0xFF
        for j in range(16):
            d = dh * np.float32(_as_int8(_byte(y, 192 + j)))
            if d == _ZERO:
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
def _kernel_f16(x, out):
    for r in prange(x.shape[0]):
        _f16_row(x[r], out[r])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _kernel_bf16(x, out):
    for r in prange(x.shape[0]):
        _bf16_row(x[r], out[r])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _kernel_q8_0(x, out):
    for r in prange(x.shape[0]):
        _q8_0_row(x[r], out[r])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _kernel_q4_0(x, out):
    for r in prange(x.shape[0]):
        _q4_0_q5_0_row(x[r], out[r], 4)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _kernel_q5_0(x, out):
    for r in prange(x.shape[0]):
        _q4_0_q5_0_row(x[r], out[r], 5)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _kernel_q4_1(x, out):
    for r in prange(x.shape[0]):
        _q4_1_q5_1_row(x[r], out[r], 4)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _kernel_q5_1(x, out):
    for r in prange(x.shape[0]):
        _q4_1_q5_1_row(x[r], out[r], 5)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _kernel_q2_k(x, out):
    for r in prange(x.shape[0]):
        _q2_k_row(x[r], out[r])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _kernel_q3_k(x, out):
    for r in prange(x.shape[0]):
        _q3_k_row(x[r], out[r])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _kernel_q4_k(x, out):
    for r in prange(x.shape[0]):
        _q4_k_q5_k_row(x[r], out[r], 4)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _kernel_q5_k(x, out):
    for r in prange(x.shape[0]):
        _q4_k_q5_k_row(x[r], out[r], 5)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _kernel_q6_k(x, out):
    no_weights = np.empty(0, np.float32)
    for r in prange(x.shape[0]):
        _q6_k_row(x[r], out[r], no_weights)


_KERNELS = {
    T.F16: _kernel_f16, T.BF16: _kernel_bf16, T.Q8_0: _kernel_q8_0,
    T.Q4_0: _kernel_q4_0, T.Q4_1: _kernel_q4_1, T.Q5_0: _kernel_q5_0, T.Q5_1: _kernel_q5_1,
    T.Q2_K: _kernel_q2_k, T.Q3_K: _kernel_q3_k, T.Q4_K: _kernel_q4_k, T.Q5_K: _kernel_q5_k,
    T.Q6_K: _kernel_q6_k,
}
SUPPORTED_TYPES = (T.F32, *_KERNELS)


def _as_type(ggml_type) -> GGMLQuantizationType:
    names = ", ".join(t.name for t in SUPPORTED_TYPES)
    try:
        t = GGMLQuantizationType(ggml_type)
    except (ValueError, TypeError):
        raise QuantizeError(f"unknown GGML type {ggml_type!r} (supported: {names})") from None
    if t not in SUPPORTED_TYPES:
        raise QuantizeError(f"cannot quantize to GGML type {t.name} (supported: {names})")
    return t


def quantize_rows(ggml_type, x: np.ndarray, quant_weights: np.ndarray | None = None) -> np.ndarray:
    """Quantize rows of float32 values to a GGML type, byte for byte as llama.cpp does.

    Mirrors ggml_quantize_chunk(type, x, dst, 0, R, K, imatrix) of llama.cpp 0c1e57098 (see the
    module docstring): without quant_weights quantize_row_<type>_ref for the block types, the
    F16 / BF16 row conversions, a copy for F32; with quant_weights, quantize_row_<type>_impl
    (quant/blocks_imatrix.py) for Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, while
    F32, F16, BF16 and Q8_0 ignore them as ggml does.
    ggml_type: a gguf.GGMLQuantizationType (or its int id) in SUPPORTED_TYPES: F32, F16, BF16,
    Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
    Shapes: x float32[R, K], C-contiguous, K a multiple of the type's block size (32 for
    Q4_0..Q8_0, 256 for the K-quants, 1 for F32/F16/BF16) -> uint8[R, K / block * type_size],
    a new array; row r holds the bytes of row r as they appear in a GGUF tensor.
    quant_weights: None, or float32[K], one importance weight per column (the imatrix entry
    in_sum2 / counts of this tensor), the same for every row.
    NaN and Inf are accepted in x (they give ggml's bytes for them).
    Raises QuantizeError for an unsupported type, an x that is not a C-contiguous 2-D float32
    numpy array, a K that is not a multiple of the block size, or quant_weights that are not
    float32[K].
    """
    t = _as_type(ggml_type)
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise QuantizeError(f"x must be a float32 numpy array, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim != 2 or not x.flags.c_contiguous:
        raise QuantizeError(f"x must be a C-contiguous 2-D array [rows, K], got shape {x.shape}"
                            f"{'' if x.flags.c_contiguous else ' (not C-contiguous)'}")
    block_size, type_size = GGML_QUANT_SIZES[t]
    n_rows, k = x.shape
    if k % block_size:
        raise QuantizeError(f"{t.name}: row length K={k} is not a multiple of the {t.name} "
                            f"block size {block_size}")
    if quant_weights is not None:
        if (not isinstance(quant_weights, np.ndarray) or quant_weights.dtype != np.float32
                or quant_weights.shape != (k,)):
            raise QuantizeError(f"quant_weights must be float32[{k}] (one per column), got "
                                f"{getattr(quant_weights, 'dtype', type(quant_weights).__name__)}"
                                f"{getattr(quant_weights, 'shape', '')}")
    if t == T.F32:
        return x.astype("<f4").view(np.uint8)
    out = np.empty((n_rows, k // block_size * type_size), np.uint8)
    if not out.size:
        return out
    from quant.blocks_imatrix import WEIGHTED_KERNELS  # imports this module's helpers
    if quant_weights is not None and t in WEIGHTED_KERNELS:
        WEIGHTED_KERNELS[t](x, out, np.ascontiguousarray(quant_weights))
    else:
        _KERNELS[t](x, out)
    return out
