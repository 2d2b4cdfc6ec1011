"""IQ4_NL, IQ4_XS and MXFP4: dequantization (ggml dequantize_row_iq4_nl / _iq4_xs / _mxfp4) and
the two-accumulator dot product of ggml_vec_dot_iq4_nl_q8_0 / ggml_vec_dot_mxfp4_q8_0.

Dequantization gives the float32 bits of gguf.quants.dequantize and of ggml's to_float: one
float32 product per value (no FMA: compiled without fastmath). Tables come from gguf.quants
(kvalues_iq4nl, kvalues_mxfp4); the e8m0 scale is ggml_e8m0_to_fp32_half.

Shapes: ``dequant_<type>(raw, out)`` reads uint8[n_blocks * type_size] and writes
float32[n_blocks * block_size].
"""
from __future__ import annotations

import numpy as np
from gguf.quants import IQ4_NL as _GGUF_IQ4_NL
from gguf.quants import MXFP4 as _GGUF_MXFP4
from numba import njit, prange

from kernels_cpu.fmath import fma
from kernels_cpu.simd import f32_from_bits, load_f16

KVALUES_IQ4NL = np.array(_GGUF_IQ4_NL.kvalues, np.int8)
KVALUES_MXFP4 = np.array(_GGUF_MXFP4.kvalues, np.int8)
_IQ4_NL_BYTES, _IQ4_XS_BYTES, _MXFP4_BYTES = 18, 136, 17  # block_iq4_nl, block_iq4_xs, block_mxfp4


@njit(cache=True, nogil=True, inline="always")
def e8m0_to_f32_half(e):
    """float32 of e8m0 exponent byte ``e`` halved (ggml_e8m0_to_fp32_half): bits 0x00200000 << e
    for e < 2 (subnormal), else (e - 1) << 23 (e = 255 gives 2**127, not NaN)."""
    e = np.uint32(e)
    if e < np.uint32(2):
        return f32_from_bits(np.uint32(0x00200000) << e)
    return f32_from_bits((e - np.uint32(1)) << np.uint32(23))


@njit(cache=True, nogil=True)
def dequant_iq4_nl(raw, out):
    """IQ4_NL (block_iq4_nl, 18 bytes / 32 values): ``f16 d | u8 qs[16]``.

    x[j] = d * kvalues_iq4nl[qs[j] & 0xF], x[j + 16] = d * kvalues_iq4nl[qs[j] >> 4] (j < 16).
    Shapes: uint8[18 nb] -> float32[32 nb].
    """
    kv = KVALUES_IQ4NL
    for b in range(out.size // 32):
        p, o = _IQ4_NL_BYTES * b, 32 * b
        d = load_f16(raw, p)
        for j in range(16):
            q = raw[p + 2 + j]
            out[o + j] = d * np.float32(kv[q & 0xF])
            out[o + j + 16] = d * np.float32(kv[q >> 4])


@njit(cache=True, nogil=True)
def dequant_iq4_xs(raw, out):
    """IQ4_XS (block_iq4_xs, 136 bytes / 256 values): ``f16 d | u16 scales_h | u8 scales_l[4] |
    u8 qs[128]``.

    Sub-block j < 8: ls = (scales_l[j/2] >> 4(j%2)) & 0xF | ((scales_h >> 2j) & 3) << 4,
    dl = d * (ls - 32) (float32); its 32 values as IQ4_NL's from qs[16j..16j+15], times dl.
    Shapes: uint8[136 nb] -> float32[256 nb].
    """
    kv = KVALUES_IQ4NL
    for b in range(out.size // 256):
        p, o = _IQ4_XS_BYTES * b, 256 * b
        d = load_f16(raw, p)
        sh = np.int32(raw[p + 2]) | (np.int32(raw[p + 3]) << 8)
        for j in range(8):
            ls = ((np.int32(raw[p + 4 + j // 2]) >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4)
            dl = d * np.float32(ls - 32)
            for i in range(16):
                q = raw[p + 8 + 16 * j + i]
                out[o + 32 * j + i] = dl * np.float32(kv[q & 0xF])
                out[o + 32 * j + i + 16] = dl * np.float32(kv[q >> 4])


@njit(cache=True, nogil=True)
def dequant_mxfp4(raw, out):
    """MXFP4 (block_mxfp4, 17 bytes / 32 values): ``u8 e | u8 qs[16]``.

    x[j] = kvalues_mxfp4[qs[j] & 0xF] * e8m0_half(e), x[j + 16] likewise with qs[j] >> 4.
    Shapes: uint8[17 nb] -> float32[32 nb].
    """
    kv = KVALUES_MXFP4
    for b in range(out.size // 32):
        p, o = _MXFP4_BYTES * b, 32 * b
        d = e8m0_to_f32_half(raw[p])
        for j in range(16):
            q = raw[p + 1 + j]
            out[o + j] = np.float32(kv[q & 0xF]) * d
            out[o + j + 16] = np.float32(kv[q >> 4]) * d


@njit(cache=True, nogil=True, inline="always")
def _block_lanes(w, r, p, kv, xqs, t, x0, lanes):
    """lanes[j] = sum of w_code * x over values 4j..4j+3 of the 32-value block at byte p of row r
    (the int32 lanes of mul_add_epi8 + madd_epi16 in ggml's AVX2 code)."""
    for j in range(8):
        s = 0
        for i in range(4 * j, 4 * j + 4):
            q = w[r, p + i % 16]
            code = kv[q & 0xF] if i < 16 else kv[q >> 4]
            s += np.int32(code) * np.int32(xqs[t, x0 + i])
        lanes[j] = s


@njit(cache=True, nogil=True, inline="always")
def _vec_dot_2acc(mxfp4, w, xqs, xd, out):
    """out[t, r] as ggml_vec_dot_iq4_nl_q8_0 / ggml_vec_dot_mxfp4_q8_0 (AVX2): blocks in pairs
    into two 8-lane accumulators, acc = fma(d_x * d_w, float(lanes), acc) (d_w: f16 d, or the
    e8m0 scale halved); sum = hsum_float_8(acc1 + acc2) = ((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7));
    an odd last block adds d * (integer total) to the sum: fused for MXFP4, two roundings for
    IQ4_NL (as this build's gcc compiled them; both checked against ggml in tests/test_iq4.py)."""
    R, T = w.shape[0], xqs.shape[0]
    nb = xqs.shape[1] // 32
    bb = _MXFP4_BYTES if mxfp4 else _IQ4_NL_BYTES
    kv = KVALUES_MXFP4 if mxfp4 else KVALUES_IQ4NL
    for r in prange(R):
        lanes = np.empty(8, np.int32)
        acc = np.zeros((2, 8), np.float32)
        for t in range(T):
            acc[:] = 0
            ib = 0
            while ib + 1 < nb:
                for k in range(2):
                    p = (ib + k) * bb
                    dw = e8m0_to_f32_half(w[r, p]) if mxfp4 else load_f16(w[r], p)
                    d = xd[t, ib + k] * dw
                    _block_lanes(w, r, p + (1 if mxfp4 else 2), kv, xqs, t, 32 * (ib + k), lanes)
                    for j in range(8):
                        acc[k, j] = fma(d, np.float32(lanes[j]), acc[k, j])
                ib += 2
            v = np.empty(8, np.float32)
            for j in range(8):
                v[j] = acc[0, j] + acc[1, j]
            sumf = ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))
            if ib < nb:
                p = ib * bb
                dw = e8m0_to_f32_half(w[r, p]) if mxfp4 else load_f16(w[r], p)
                d = xd[t, ib] * dw
                _block_lanes(w, r, p + (1 if mxfp4 else 2), kv, xqs, t, 32 * ib, lanes)
                total = lanes.sum()
                if mxfp4:  # gcc contracts MXFP4's tail to an fma, not IQ4_NL's
                    sumf = fma(d, np.float32(total), sumf)
                else:
                    sumf = sumf + d * np.float32(total)
            out[t, r] = sumf
