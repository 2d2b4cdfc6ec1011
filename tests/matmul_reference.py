"""numpy model of llama.cpp's quantized matmul arithmetic on x86-64 (AVX-512 VNNI build), for tests.

Written from a reading of ggml-cpu (arch/x86/quants.c ggml_vec_dot_*, llamafile/sgemm.cpp
tinyBLAS_Q0_AVX, arch/x86/repack.cpp ggml_gemv/gemm_q4_K_8x8_q8_K, tiled/tiled-kernel.cpp
tiled_run_micro_vnni_8x16) and checked against its outputs. Integer parts are exact, so only
the float structure is modelled: which integer sums become floats, which scales multiply them,
and the order of the float multiply-adds. ``fma32`` is a correctly rounded float32 fma.

Entry point: ``reference_matmul(w, ggml_type, x)`` -> float32[T, R], the bits llama.cpp gives.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from kernels_cpu.quantize_act import quantize_q8_0, quantize_q8_1, quantize_q8_k

F32 = np.float32


def fma32(a, b, c) -> np.ndarray:
    """float32 a*b + c with one rounding (float64 product is exact; a double-rounding tie in the
    float64 sum is resolved with the exact error term of the sum)."""
    a, b, c = (np.asarray(v, F32) for v in (a, b, c))
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    r = s.astype(F32)
    bits = s.view(np.uint64)
    tie = ((bits & np.uint64((1 << 29) - 1)) == np.uint64(1 << 28)) & (err != 0)
    if tie.any():
        up = np.nextafter(r, F32(np.inf))
        down = np.nextafter(r, F32(-np.inf))
        lo = np.where(r.astype(np.float64) > s, down, r)
        hi = np.where(r.astype(np.float64) > s, r, up)
        r = np.where(tie, np.where(err > 0, hi, lo), r)
    return r


def hsum8(v: np.ndarray) -> np.ndarray:
    """ggml's hsum_float_8 of the last axis (8 lanes): ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))."""
    h = v[..., :4] + v[..., 4:]
    return (h[..., 0] + h[..., 2]) + (h[..., 1] + h[..., 3])


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    return raw[..., at:at + 2].copy().view(np.float16)[..., 0].astype(F32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """u8[..., 16] -> [..., 32]: low nibbles then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """u8[..., 4] -> [..., 32] bit j of the little-endian word."""
    return np.unpackbits(qh, axis=-1, bitorder="little").astype(np.int64)


def _scale_min_k4(sc: np.ndarray):
    """u8[..., 12] packed 6-bit scales/mins of Q4_K/Q5_K -> (scales, mins) int64[..., 8]."""
    sc = sc.astype(np.int64)
    s = np.empty(sc.shape[:-1] + (8,), np.int64)
    m = np.empty_like(s)
    s[..., :4], m[..., :4] = sc[..., :4] & 63, sc[..., 4:8] & 63
    s[..., 4:] = (sc[..., 8:12] & 0x0F) | ((sc[..., 0:4] >> 6) << 4)
    m[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return s, m


def unpack(w: np.ndarray, t: T) -> dict:
    """Integer quants and scales of weight rows uint8[R, row_bytes] (ggml-common.h layouts).

    q: int64[R, nb, block] as ggml's kernels multiply them (Q4_0/Q5_0 offset removed, Q3_K
    signed, Q4_1/Q5_1 and the other K-quants unsigned, Q6_K 0..63 with "offset" 32);
    d (and m / dmin) float32[R, nb]; K-quants: scale and min of each 16 values sc16, min16
    int64[R, nb, 16] (Q4_K/Q5_K's 32-value ones repeated).
    """
    block, size = GGML_QUANT_SIZES[t]
    raw = w.reshape(w.shape[0], -1, size)
    if t == T.Q8_0:
        return {"d": _f16(raw, 0), "q": raw[..., 2:].view(np.int8).astype(np.int64)}
    if t == T.Q4_0:
        return {"d": _f16(raw, 0), "q": _nibbles(raw[..., 2:]) - 8}
    if t == T.Q5_0:
        return {"d": _f16(raw, 0), "q": _nibbles(raw[..., 6:]) + 16 * _bits32(raw[..., 2:6]) - 16}
    if t == T.Q4_1:
        return {"d": _f16(raw, 0), "m": _f16(raw, 2), "q": _nibbles(raw[..., 4:])}
    if t == T.Q5_1:
        return {"d": _f16(raw, 0), "m": _f16(raw, 2), "q": _nibbles(raw[..., 8:]) + 16 * _bits32(raw[..., 4:8])}
    if t in (T.Q4_K, T.Q5_K):
        scales, mins = _scale_min_k4(raw[..., 4:16])
        qs = raw[..., 16:144] if t == T.Q4_K else raw[..., 48:176]
        q = np.stack([qs[..., 32 * (j // 2):32 * (j // 2) + 32] >> (4 * (j % 2)) & 0x0F for j in range(8)], -2)
        q = q.astype(np.int64)
        if t == T.Q5_K:
            qh = raw[..., 16:48].astype(np.int64)
            q += np.stack([(qh >> j) & 1 for j in range(8)], -2) * 16
        return {"d": _f16(raw, 0), "dmin": _f16(raw, 2), "sc16": np.repeat(scales, 2, -1),
                "min16": np.repeat(mins, 2, -1), "q": q.reshape(*raw.shape[:2], 256)}
    if t == T.Q6_K:
        ql, qh = raw[..., :128].astype(np.int64), raw[..., 128:192].astype(np.int64)
        parts = []
        for h in range(2):
            for g in range(4):
                low = ql[..., 64 * h + 32 * (g % 2):64 * h + 32 * (g % 2) + 32]
                low = low & 0x0F if g < 2 else low >> 4
                parts.append(low | ((qh[..., 32 * h:32 * h + 32] >> (2 * g)) & 3) << 4)
        return {"d": _f16(raw, 208), "sc16": raw[..., 192:208].view(np.int8).astype(np.int64),
                "q": np.concatenate(parts, -1), "offset": 32}
    if t in (T.Q2_K, T.Q3_K):
        qs = raw[..., 16:80] if t == T.Q2_K else raw[..., 32:96]
        q = np.concatenate([(qs[..., 32 * h:32 * h + 32] >> (2 * g)) & 3 for h in range(2) for g in range(4)], -1)
        q = q.astype(np.int64)
        if t == T.Q2_K:
            sc = raw[..., :16].astype(np.int64)
            return {"d": _f16(raw, 80), "dmin": _f16(raw, 82), "sc16": sc & 0x0F, "min16": sc >> 4, "q": q}
        hbits = np.concatenate([(raw[..., :32] >> k) & 1 for k in range(8)], -1).astype(np.int64)
        low = np.concatenate([raw[..., 96:104] & 0x0F, raw[..., 96:104] >> 4], -1).astype(np.int64)
        high = np.stack([(raw[..., 104 + i % 4] >> (2 * (i // 4))) & 3 for i in range(16)], -1).astype(np.int64)
        return {"d": _f16(raw, 108), "sc16": (low | high << 4) - 32, "q": q - 4 + 4 * hbits}
    raise NotImplementedError(f"no reference for {t.name}")


def _lane_sums(wq: np.ndarray, xq: np.ndarray, width: int) -> np.ndarray:
    """int64[T, R, nb, n/width]: sums of ``width`` consecutive products per block."""
    Tn, R = xq.shape[0], wq.shape[0]
    prod = wq[None] * xq[:, None]
    return prod.reshape(Tn, R, prod.shape[2], -1, width).sum(-1)


def _q0_lanes(u: dict, t: T, x: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_q{4,5,8}_0_q8_0 / tinyBLAS_Q0_AVX (same float structure) and _q{4,5}_1_q8_1:
    8 lanes of 4 products per block, acc = fma(d_w*d_x, lane, acc), hsum8 (+ fma chain of m*s)."""
    Tn, nb = x.shape[0], u["q"].shape[1]
    if t in (T.Q4_1, T.Q5_1):
        qs, dx, sx = quantize_q8_1(x)
    else:
        qs, dx = quantize_q8_0(x)
    lanes = _lane_sums(u["q"], qs.reshape(Tn, nb, 32).astype(np.int64), 4).astype(F32)
    acc = np.zeros(lanes.shape[:2] + (8,), F32)
    summs = np.zeros(lanes.shape[:2], F32)
    for b in range(nb):
        d = u["d"][None, :, b] * dx[:, None, b]
        acc = fma32(d[..., None], lanes[:, :, b], acc)
        if "m" in u:
            summs = fma32(u["m"][None, :, b], sx[:, None, b], summs)
    out = hsum8(acc)
    return out + summs if "m" in u else out


def _q8k(x: np.ndarray):
    """Q8_K activations: quants int64[T, nb, 256], d float32[T, nb], bsums int64[T, nb, 16]."""
    qs, d, bsums = quantize_q8_k(x)
    return qs.reshape(x.shape[0], -1, 256).astype(np.int64), d, bsums.reshape(x.shape[0], -1, 16).astype(np.int64)


def _k_lanes(u: dict, xq: np.ndarray) -> np.ndarray:
    """int64[T, R, nb, 8]: lane m = sum over the 32-value chunks c of scale * q * x over values
    32c+4m .. 32c+4m+3 (ggml's maddubs / madd lanes), q without any offset."""
    a = _lane_sums(np.repeat(u["sc16"], 16, axis=-1) * u["q"], xq, 4)
    return a.reshape(*a.shape[:3], 8, 8).sum(-2)


def _pairs16(v16: np.ndarray, bs: np.ndarray) -> np.ndarray:
    """int64[T, R, nb, 8]: lane j = v[2j]*bsums[2j] + v[2j+1]*bsums[2j+1] (values 32j..32j+31)."""
    prod = v16[None] * bs[:, None]
    return prod.reshape(*prod.shape[:3], 8, 2).sum(-1)


def _k_vec_dot(u: dict, t: T, x: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_q{2,3,4,5,6}_K_q8_K (AVX2): 8 lanes (_k_lanes) scaled by d = d_x*d_w per
    super-block, hsum_float_8. Q6_K: lanes minus 32 * _pairs16(scales); Q2_K: first, into the
    same lanes, _pairs16(mins) scaled by -d_x*dmin; Q4_K: 4 more lanes of mins (sub-block
    pairs) with -d_x*dmin, added as (m0+m2)+(m1+m3); Q5_K: a scalar fma chain of the mins total."""
    xq, dx, bs = _q8k(x)
    lanes = _k_lanes(u, xq)
    if t == T.Q6_K:
        lanes = lanes - 32 * _pairs16(u["sc16"], bs)
    lanes = lanes.astype(F32)
    mins = _pairs16(u["min16"], bs) if "min16" in u else None
    acc = np.zeros(lanes.shape[:2] + (8,), F32)
    acc_m = np.zeros(lanes.shape[:2] + (4,), F32)
    summs = np.zeros(lanes.shape[:2], F32)
    for b in range(lanes.shape[2]):
        d = dx[:, None, b] * u["d"][None, :, b]
        if mins is not None:
            neg_dmin = -dx[:, None, b] * u["dmin"][None, :, b]
            if t == T.Q2_K:
                acc = fma32(neg_dmin[..., None], mins[:, :, b].astype(F32), acc)
            elif t == T.Q4_K:
                acc_m = fma32(neg_dmin[..., None], mins[:, :, b].reshape(*d.shape, 4, 2).sum(-1).astype(F32), acc_m)
            else:
                summs = fma32(mins[:, :, b].sum(-1).astype(F32), neg_dmin, summs)
        acc = fma32(d[..., None], lanes[:, :, b], acc)
    out = hsum8(acc)
    if t == T.Q4_K:
        return out + ((acc_m[..., 0] + acc_m[..., 2]) + (acc_m[..., 1] + acc_m[..., 3]))
    return out + summs if t == T.Q5_K else out


def _group_sums(u: dict, xq: np.ndarray, bs: np.ndarray, group: int):
    """(I, M) int64[T, R, nb, 256/group]: per ``group`` values, the exact sums of
    scale*(q - offset)*x and of min*bsum (M: zeros for types without mins)."""
    s16 = _lane_sums(u["q"] - u.get("offset", 0), xq, 16) * u["sc16"][None]
    i = s16.reshape(*s16.shape[:3], -1, group // 16).sum(-1)
    if "min16" not in u:
        return i, np.zeros_like(i)
    m = u["min16"][None] * bs[:, None]
    return i, m.reshape(*m.shape[:3], -1, group // 16).sum(-1)


def _repacked(u: dict, x: np.ndarray, group: int) -> np.ndarray:
    """ggml_gemv_{q4_K,q2_K}_8x8_q8_K (group 256) / ggml_gemm_.. (64 for Q4_K, 128 for Q2_K;
    its activations come from quantize_mat_q8_K, whose +-max tie rule flips q and d together
    and so changes nothing): acc += I*(d_w*d_x), accm += M*(dmin*d_x) per group, out = acc - accm."""
    xq, dx, bs = _q8k(x)
    i, m = _group_sums(u, xq, bs, group)
    acc = np.zeros(i.shape[:2], F32)
    accm = np.zeros(i.shape[:2], F32)
    for b in range(i.shape[2]):
        d = u["d"][None, :, b] * dx[:, None, b]
        dmin = u["dmin"][None, :, b] * dx[:, None, b]
        for g in range(i.shape[3]):
            acc = fma32(i[:, :, b, g].astype(F32), d, acc)
            accm = fma32(m[:, :, b, g].astype(F32), dmin, accm)
    return acc - accm


def _tiled(u: dict, x: np.ndarray) -> np.ndarray:
    """tiled_run_micro_vnni_8x16 (K-quant batches of >= 8 rows, weights not repacked): per
    super-block exact totals S1 (and mins S2); r = S1*d_w, r = fma(-dmin, S2, r) when the type
    has mins; buf = fma(r, d_x, buf)."""
    xq, dx, bs = _q8k(x)
    s1, s2 = (v[..., 0] for v in _group_sums(u, xq, bs, 256))
    buf = np.zeros(s1.shape[:2], F32)
    for b in range(s1.shape[2]):
        r = s1[:, :, b].astype(F32) * u["d"][None, :, b]
        if "min16" in u:
            r = fma32(-u["dmin"][None, :, b], s2[:, :, b].astype(F32), r)
        buf = fma32(r, dx[:, None, b], buf)
    return buf


def reference_matmul(w: np.ndarray, t, x: np.ndarray) -> np.ndarray:
    """float32[T, R]: llama.cpp's result for weight rows w (uint8[R, row_bytes], type t) and
    activations x float32[T, K], choosing the kernel llama.cpp's CPU backend chooses."""
    t = T(t)
    u = unpack(w, t)
    R, Tn = w.shape[0], x.shape[0]
    if t == T.Q4_0 and R % 8 == 0:  # repacked q4_0_8x8: gemv and gemm alike, one fma per block
        qs, dx = quantize_q8_0(x)
        tot = _lane_sums(u["q"], qs.reshape(Tn, -1, 32).astype(np.int64), 32)[..., 0].astype(F32)
        acc = np.zeros((Tn, R), F32)
        for b in range(tot.shape[2]):
            acc = fma32(tot[:, :, b], u["d"][None, :, b] * dx[:, None, b], acc)
        return acc
    if t in (T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_1, T.Q5_1):
        return _q0_lanes(u, t, x)
    if t in (T.Q4_K, T.Q2_K) and R % 8 == 0:
        n4 = Tn - Tn % 4 if Tn > 3 else 0
        out = np.empty((Tn, R), F32)
        if n4:
            out[:n4] = _repacked(u, x[:n4], 64 if t == T.Q4_K else 128)
        if n4 < Tn:
            out[n4:] = _repacked(u, x[n4:], 256)
        return out
    return _tiled(u, x) if Tn >= 8 else _k_vec_dot(u, t, x)
