"""Dequantization of GGML tensor data to float32 (ggml ``dequantize_row_*``; llama.cpp ``get_rows``).

Every kernel gives the same float32 bits as ``gguf.quants.dequantize`` (gguf-py 0.19): the same
products in the same order, all in float32 (never float64, no FMA contraction: these kernels
are compiled without fastmath). Block layouts are those of ggml-common.h; each kernel's
docstring draws its block. All multi-byte fields are little-endian; ``f16`` is IEEE binary16.

Shapes: a kernel ``dequant_<type>(raw, out)`` reads ``raw: uint8[n_blocks * type_size]`` and
writes ``out: float32[n_blocks * block_size]`` (both 1-D, C-contiguous).
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from kernels_cpu.ggml_types import QK_K, TYPES, kernels
from kernels_cpu.iq1tq import dequant_iq1_m, dequant_iq1_s, dequant_tq1_0, dequant_tq2_0  # noqa: F401
from kernels_cpu.iq4 import dequant_iq4_nl, dequant_iq4_xs, dequant_mxfp4  # noqa: F401
from kernels_cpu.iq23 import (  # noqa: F401
    dequant_iq2_s,
    dequant_iq2_xs,
    dequant_iq2_xxs,
    dequant_iq3_s,
    dequant_iq3_xxs,
)
from kernels_cpu.simd import f16_bits_to_f32_bits, load_f16


class QuantFormatError(ValueError):
    """Quantized data that does not fit its GGML type (size, dtype, layout) or an unknown type."""


T = GGMLQuantizationType
# bytes per block (the type table's type_size), constants in the kernels
(_Q4_0_BYTES, _Q4_1_BYTES, _Q5_0_BYTES, _Q5_1_BYTES, _Q8_0_BYTES, _Q2_K_BYTES, _Q3_K_BYTES, _Q4_K_BYTES,
 _Q5_K_BYTES, _Q6_K_BYTES) = (TYPES[t].type_size for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K,
                                                           T.Q4_K, T.Q5_K, T.Q6_K))


# ---------------------------------------------------------------------------------------------
# float formats


@njit(cache=True, nogil=True)
def dequant_f32(raw, out):
    """F32: 4 bytes per element, copied bit for bit. Shapes: raw uint8[4n] -> out float32[n]."""
    bits = out.view(np.uint32)
    for i in range(out.size):
        b = 4 * i
        bits[i] = (np.uint32(raw[b]) | (np.uint32(raw[b + 1]) << np.uint32(8))
                   | (np.uint32(raw[b + 2]) << np.uint32(16)) | (np.uint32(raw[b + 3]) << np.uint32(24)))


@njit(cache=True, nogil=True)
def dequant_f16(raw, out):
    """F16: IEEE binary16, widened exactly (NaN payloads kept). Shapes: uint8[2n] -> float32[n]."""
    bits = out.view(np.uint32)
    for i in range(out.size):
        bits[i] = f16_bits_to_f32_bits(np.uint32(raw[2 * i]) | (np.uint32(raw[2 * i + 1]) << np.uint32(8)))


@njit(cache=True, nogil=True)
def dequant_bf16(raw, out):
    """BF16: the upper 16 bits of a float32 (ggml_compute_bf16_to_fp32). Shapes: uint8[2n] -> float32[n]."""
    bits = out.view(np.uint32)
    for i in range(out.size):
        bits[i] = (np.uint32(raw[2 * i]) << np.uint32(16)) | (np.uint32(raw[2 * i + 1]) << np.uint32(24))


# ---------------------------------------------------------------------------------------------
# 32-element blocks


@njit(cache=True, nogil=True)
def dequant_q4_0(raw, out):
    """Q4_0 (block_q4_0, 18 bytes / 32 values): ``f16 d | u8 qs[16]``.

    Value j < 16 is ``qs[j] & 0xF``, value j + 16 is ``qs[j] >> 4``; x = d * (q - 8).
    Shapes: uint8[18 nb] -> float32[32 nb].
    """
    for b in range(out.size // 32):
        p, o = _Q4_0_BYTES * b, 32 * b
        d = load_f16(raw, p)
        for j in range(16):
            q = raw[p + 2 + j]
            out[o + j] = d * np.float32(np.int32(q & 0xF) - 8)
            out[o + j + 16] = d * np.float32(np.int32(q >> 4) - 8)


@njit(cache=True, nogil=True)
def dequant_q4_1(raw, out):
    """Q4_1 (block_q4_1, 20 bytes / 32 values): ``f16 d | f16 m | u8 qs[16]``; x = d * q + m.

    Nibble order as Q4_0. Shapes: uint8[20 nb] -> float32[32 nb].
    """
    for b in range(out.size // 32):
        p, o = _Q4_1_BYTES * b, 32 * b
        d = load_f16(raw, p)
        m = load_f16(raw, p + 2)
        for j in range(16):
            q = raw[p + 4 + j]
            out[o + j] = d * np.float32(q & 0xF) + m
            out[o + j + 16] = d * np.float32(q >> 4) + m


@njit(cache=True, inline="always")
def _load_u32(raw, p):
    return (np.uint32(raw[p]) | (np.uint32(raw[p + 1]) << np.uint32(8))
            | (np.uint32(raw[p + 2]) << np.uint32(16)) | (np.uint32(raw[p + 3]) << np.uint32(24)))


@njit(cache=True, nogil=True)
def dequant_q5_0(raw, out):
    """Q5_0 (block_q5_0, 22 bytes / 32 values): ``f16 d | u32 qh | u8 qs[16]``.

    Value j: low 4 bits as Q4_0, bit 4 = bit j of qh; x = d * (q - 16).
    Shapes: uint8[22 nb] -> float32[32 nb].
    """
    for b in range(out.size // 32):
        p, o = _Q5_0_BYTES * b, 32 * b
        d = load_f16(raw, p)
        qh = _load_u32(raw, p + 2)
        for j in range(16):
            q = raw[p + 6 + j]
            lo = np.int32(q & 0xF) | (np.int32((qh >> np.uint32(j)) & np.uint32(1)) << 4)
            hi = np.int32(q >> 4) | (np.int32((qh >> np.uint32(j + 16)) & np.uint32(1)) << 4)
            out[o + j] = d * np.float32(lo - 16)
            out[o + j + 16] = d * np.float32(hi - 16)


@njit(cache=True, nogil=True)
def dequant_q5_1(raw, out):
    """Q5_1 (block_q5_1, 24 bytes / 32 values): ``f16 d | f16 m | u32 qh | u8 qs[16]``; x = d * q + m.

    Bits as Q5_0. Shapes: uint8[24 nb] -> float32[32 nb].
    """
    for b in range(out.size // 32):
        p, o = _Q5_1_BYTES * b, 32 * b
        d = load_f16(raw, p)
        m = load_f16(raw, p + 2)
        qh = _load_u32(raw, p + 4)
        for j in range(16):
            q = raw[p + 8 + j]
            lo = np.int32(q & 0xF) | (np.int32((qh >> np.uint32(j)) & np.uint32(1)) << 4)
            hi = np.int32(q >> 4) | (np.int32((qh >> np.uint32(j + 16)) & np.uint32(1)) << 4)
            out[o + j] = d * np.float32(lo) + m
            out[o + j + 16] = d * np.float32(hi) + m


@njit(cache=True, nogil=True)
def dequant_q8_0(raw, out):
    """Q8_0 (block_q8_0, 34 bytes / 32 values): ``f16 d | i8 qs[32]``; x = q * d.

    Shapes: uint8[34 nb] -> float32[32 nb].
    """
    for b in range(out.size // 32):
        p, o = _Q8_0_BYTES * b, 32 * b
        d = load_f16(raw, p)
        for j in range(32):
            out[o + j] = np.float32(np.int8(raw[p + 2 + j])) * d


# ---------------------------------------------------------------------------------------------
# K-quants: 256-element super-blocks


@njit(cache=True, nogil=True)
def dequant_q2_k(raw, out):
    """Q2_K (block_q2_K, 84 bytes / 256 values): ``u8 scales[16] | u8 qs[64] | f16 d | f16 dmin``.

    scales[i] = (min << 4) | scale of the 16 values i*16..; value e has
    q = (qs[32*(e//128) + e%32] >> 2*((e%128)//32)) & 3;  x = (d*scale) * q - (dmin*min).
    Shapes: uint8[84 nb] -> float32[256 nb].
    """
    for b in range(out.size // QK_K):
        p, o = _Q2_K_BYTES * b, QK_K * b
        d = load_f16(raw, p + 80)
        dmin = load_f16(raw, p + 82)
        for h in range(2):
            for g in range(4):
                for half in range(2):
                    sc = raw[p + 8 * h + 2 * g + half]
                    dl = d * np.float32(sc & 0xF)
                    ml = dmin * np.float32(sc >> 4)
                    for k in range(16):
                        i = 16 * half + k
                        q = (raw[p + 16 + 32 * h + i] >> (2 * g)) & 3
                        out[o + 128 * h + 32 * g + i] = dl * np.float32(q) - ml


@njit(cache=True, nogil=True)
def dequant_q3_k(raw, out):
    """Q3_K (block_q3_K, 110 bytes / 256 values): ``u8 hmask[32] | u8 qs[64] | u8 scales[12] | f16 d``.

    16 six-bit scales s_i (stored minus 32), packed::

        byte 0..7 : low 4 bits of s_0..s_7 (low nibble) and of s_8..s_15 (high nibble)
        byte 8..11: bits 4-5 of s_i in byte 8 + i%4, at bit 2*(i//4)

    Value e: low = (qs[32*(e//128) + e%32] >> 2*((e%128)//32)) & 3, high bit h = bit e//32 of
    hmask[e%32]; q = low - 4*(1 - h);  x = (d * (s_{e//16} - 32)) * q.
    Shapes: uint8[110 nb] -> float32[256 nb].
    """
    for b in range(out.size // QK_K):
        p, o = _Q3_K_BYTES * b, QK_K * b
        d = load_f16(raw, p + 108)
        for h in range(2):
            for g in range(4):
                for half in range(2):
                    s = 8 * h + 2 * g + half
                    lo = (raw[p + 96 + s % 8] >> (4 * (s // 8))) & 0xF
                    hi = (raw[p + 104 + s % 4] >> (2 * (s // 4))) & 3
                    dl = d * np.float32(np.int32(lo | (hi << 4)) - 32)
                    for k in range(16):
                        i = 16 * half + k
                        low = np.int32((raw[p + 32 + 32 * h + i] >> (2 * g)) & 3)
                        bit = np.int32((raw[p + i] >> (4 * h + g)) & 1)
                        out[o + 128 * h + 32 * g + i] = dl * np.float32(low - ((bit ^ 1) << 2))


@njit(cache=True, inline="always")
def scale_min_k4(raw, p, j):
    """Six-bit (scale, min) of sub-block j from the 12 packed bytes at raw[p:] (ggml get_scale_min_k4).

    ::

        byte 0..3 : scale j (bits 0-5) | bits 4-5 of scale j+4 (bits 6-7)
        byte 4..7 : min j   (bits 0-5) | bits 4-5 of min j+4   (bits 6-7)
        byte 8..11: low 4 bits of scale j+4 (bits 0-3) | low 4 bits of min j+4 (bits 4-7)
    """
    if j < 4:
        return np.int32(raw[p + j] & 63), np.int32(raw[p + j + 4] & 63)
    sc = (raw[p + j + 4] & 0xF) | ((raw[p + j - 4] >> 6) << 4)
    mn = (raw[p + j + 4] >> 4) | ((raw[p + j] >> 6) << 4)
    return np.int32(sc), np.int32(mn)


@njit(cache=True, inline="always")
def _dequant_q45_k(raw, out, block_bytes, has_qh):
    """Shared body of Q4_K and Q5_K: ``f16 d | f16 dmin | u8 scales[12] | [u8 qh[32]] | u8 qs[128]``."""
    qs_at = 48 if has_qh else 16
    for b in range(out.size // QK_K):
        p, o = block_bytes * b, QK_K * b
        d = load_f16(raw, p)
        dmin = load_f16(raw, p + 2)
        for j in range(8):
            sc, mn = scale_min_k4(raw, p + 4, j)
            dl = d * np.float32(sc)
            ml = dmin * np.float32(mn)
            shift = 4 * (j % 2)
            for i in range(32):
                q = (raw[p + qs_at + 32 * (j // 2) + i] >> shift) & 0xF
                if has_qh:
                    q |= ((raw[p + 16 + i] >> j) & 1) << 4
                out[o + 32 * j + i] = dl * np.float32(q) - ml


@njit(cache=True, nogil=True)
def dequant_q4_k(raw, out):
    """Q4_K (block_q4_K, 144 bytes / 256 values): ``f16 d | f16 dmin | u8 scales[12] | u8 qs[128]``.

    Eight sub-blocks of 32 with six-bit (scale, min) (see scale_min_k4). Sub-block j takes the
    low (j even) or high (j odd) nibbles of qs[32*(j//2) : 32*(j//2) + 32];
    x = (d*scale) * q - (dmin*min). Shapes: uint8[144 nb] -> float32[256 nb].
    """
    _dequant_q45_k(raw, out, _Q4_K_BYTES, False)


@njit(cache=True, nogil=True)
def dequant_q5_k(raw, out):
    """Q5_K (block_q5_K, 176 bytes / 256 values): ``f16 d | f16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]``.

    As Q4_K, plus bit 4 of value 32*j + i = bit j of qh[i]. Shapes: uint8[176 nb] -> float32[256 nb].
    """
    _dequant_q45_k(raw, out, _Q5_K_BYTES, True)


@njit(cache=True, nogil=True)
def dequant_q6_k(raw, out):
    """Q6_K (block_q6_K, 210 bytes / 256 values): ``u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d``.

    Value e = 128*h + 32*g + i (h < 2, g < 4, i < 32): low 4 bits from ql[64*h + 32*(g%2) + i]
    (low nibble for g < 2, high for g >= 2), bits 4-5 from (qh[32*h + i] >> 2*g) & 3;
    x = (d * scales[e//16]) * (q - 32). Shapes: uint8[210 nb] -> float32[256 nb].
    """
    for b in range(out.size // QK_K):
        p, o = _Q6_K_BYTES * b, QK_K * b
        d = load_f16(raw, p + 208)
        for h in range(2):
            for g in range(4):
                for half in range(2):
                    dl = d * np.float32(np.int8(raw[p + 192 + 8 * h + 2 * g + half]))
                    for k in range(16):
                        i = 16 * half + k
                        lo = (raw[p + 64 * h + 32 * (g % 2) + i] >> (4 * (g // 2))) & 0xF
                        hi = (raw[p + 128 + 32 * h + i] >> (2 * g)) & 3
                        out[o + 128 * h + 32 * g + i] = dl * np.float32(np.int32(lo | (hi << 4)) - 32)


# ---------------------------------------------------------------------------------------------
# dispatch

KERNELS = kernels(globals(), "dequant")  # dequant_<type> of every row of the type table


def as_ggml_type(ggml_type) -> GGMLQuantizationType:
    """Normalize a GGML type (enum, int id or name such as ``"Q4_K"``); unsupported -> QuantFormatError."""
    try:
        if isinstance(ggml_type, str):
            t = GGMLQuantizationType[ggml_type.upper()]
        else:
            t = GGMLQuantizationType(int(ggml_type))
    except (KeyError, ValueError, TypeError):
        raise QuantFormatError(f"unknown GGML type {ggml_type!r}") from None
    if t not in KERNELS:
        supported = ", ".join(k.name for k in KERNELS)
        raise QuantFormatError(f"GGML type {t.name} is not supported (supported: {supported})")
    return t


def _check_bytes(raw, t: GGMLQuantizationType, what: str) -> tuple[int, int]:
    """Validate a uint8 C-contiguous array of whole blocks; return (block_size, type_size)."""
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8:
        raise QuantFormatError(f"{what} must be a uint8 numpy array, got {getattr(raw, 'dtype', type(raw))}")
    if raw.ndim == 0 or not raw.flags.c_contiguous:
        raise QuantFormatError(f"{what} must be a C-contiguous array with at least one dimension")
    block_size, type_size = TYPES[t].block_size, TYPES[t].type_size
    if raw.shape[-1] % type_size:
        raise QuantFormatError(
            f"{what}: last dimension of {raw.shape[-1]} bytes is not a whole number of "
            f"{t.name} blocks ({type_size} bytes each)")
    return block_size, type_size


def dequantize(raw: np.ndarray, ggml_type, n_elements: int | None = None) -> np.ndarray:
    """Dequantize whole GGML blocks to float32 (mirrors gguf.quants.dequantize, bit for bit).

    Shapes: raw uint8[..., n_bytes] (C-contiguous, n_bytes a multiple of the type's block bytes)
    -> float32[..., n_bytes // type_size * block_size], a new array.
    ``n_elements``, if given, must equal the number of values ``raw`` holds (a size check).
    Raises QuantFormatError for an unknown or unsupported type, a wrong dtype or layout,
    partial blocks, or an ``n_elements`` mismatch.
    """
    t = as_ggml_type(ggml_type)
    block_size, type_size = _check_bytes(raw, t, f"{t.name} data")
    shape = (*raw.shape[:-1], raw.shape[-1] // type_size * block_size)
    out = np.empty(shape, np.float32)
    if n_elements is not None and int(n_elements) != out.size:
        raise QuantFormatError(f"{t.name} data holds {out.size} values, expected n_elements={n_elements}")
    if out.size:
        KERNELS[t](raw.reshape(-1), out.reshape(-1))
    return out


def dequantize_rows(rows: np.ndarray, ggml_type, ids, out: np.ndarray) -> np.ndarray:
    """Gather rows of a quantized matrix and dequantize them (llama.cpp get_rows, embedding lookup).

    Shapes: rows uint8[R, row_bytes] (e.g. GGUFFile.tensor_rows), ids int[n] with 0 <= id < R,
    out float32[n, K] with K = row_bytes // type_size * block_size (C-contiguous); returns out.
    Raises QuantFormatError for a bad type/layout/out shape, IndexError for an id out of range.
    """
    t = as_ggml_type(ggml_type)
    block_size, type_size = _check_bytes(rows, t, f"{t.name} rows")
    if rows.ndim != 2:
        raise QuantFormatError(f"rows must be 2-D [n_rows, row_bytes], got shape {rows.shape}")
    ids = np.asarray(ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise QuantFormatError(f"ids must be a 1-D integer array, got {ids.dtype} shape {ids.shape}")
    k = rows.shape[1] // type_size * block_size
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (ids.size, k)
            or not out.flags.c_contiguous):
        raise QuantFormatError(f"out must be C-contiguous float32[{ids.size}, {k}], got "
                               f"{getattr(out, 'dtype', type(out))} {getattr(out, 'shape', '')}")
    if ids.size and (ids.min() < 0 or ids.max() >= rows.shape[0]):
        bad = ids[(ids < 0) | (ids >= rows.shape[0])][0]
        raise IndexError(f"row id {bad} out of range for {rows.shape[0]} rows")
    if ids.size:
        KERNELS[t](rows[ids].reshape(-1), out.reshape(-1))
    return out
