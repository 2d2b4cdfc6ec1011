"""IQ4_NL / IQ4_XS / MXFP4 matmul entry points (numba), as llama.cpp's CPU backend (AVX2)
computes them; imported into kernels_cpu.matmul_kernels (shapes as there: w uint8[R, row_bytes],
xqs int16[T, K], xd float32[T, K/block], xbsums int16[T, K/16], out float32[T, R]).

numba's on-disk cache keys these kernels on this file only: after editing the modules they
build on (iq4, iq4_decoders, matmul_tiles, matmul_tiling), clear kernels_cpu/__pycache__/iq4_kernels.*.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType
from numba import njit

from kernels_cpu.iq4 import _vec_dot_2acc
from kernels_cpu.matmul_tiles import GEMV, TILED, VEC_DOT
from kernels_cpu.matmul_tiling import NR, NR_ROWS, NT, NT_WIDE, _block_sums_32, _blocks, _rows, _tiled, many_rows
from kernels_cpu.simd import HAS_VNNI

T_ = GGMLQuantizationType
_IQ4_NL, _IQ4_XS, _MXFP4 = int(T_.IQ4_NL), int(T_.IQ4_XS), int(T_.MXFP4)
ND_GEMV = 8  # decode GEMV tile rows: their 8 block sums make one float vector (kernels_cpu.iq4_avx2)


@njit(cache=True, inline="always")
def _plain_k(fmt, nr, nd, w, xqs, xd, xbsums, out):
    """As matmul_kernels._plain_k: the tiled kernel for T >= 8 (ggml_tiled_min_batch; with
    AVX-512 VNNI in 16-row panels when R >= 16, matmul_tiling.many_rows), else VEC_DOT."""
    if xqs.shape[0] >= 8:
        if HAS_VNNI:
            many_rows(fmt, TILED, w, xqs, xd, xbsums, out)
        else:
            _blocks(fmt, TILED, nr, True, w, xqs, xd, xbsums, out, NT_WIDE)
    else:
        _tiled(fmt, VEC_DOT, nd, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq4_nl_q8_0(w, xqs, xd, out):
    """IQ4_NL weights (plain buffer) x Q8_0: ggml_vec_dot_iq4_nl_q8_0 (two accumulators) for
    T = 1, tinyBLAS_Q0_AVX (one 8-lane accumulator: the VEC_DOT tile) for batches."""
    if xqs.shape[0] == 1:
        _vec_dot_2acc(False, w, xqs, xd, out)
    else:
        _tiled(_IQ4_NL, VEC_DOT, NR, w, xqs, xd, xd, out)


@njit(cache=True, inline="always")
def _gemv_lanes(fmt, w, xqs, xd, out):
    """The GEMV tile over all outputs: ND_GEMV x 1 tiles for decode (T < NT; one integer sum per
    block and row, 8 rows filling one float vector), NR x NT tiles for more rows."""
    if xqs.shape[0] < NT:
        _rows(fmt, GEMV, ND_GEMV, w, xqs, xd, xd, out)
    else:
        _blocks(fmt, GEMV, NR, True, w, xqs, xd, xd, out)


@njit(cache=True, inline="always")
def _gemv_rows(fmt, w, xqs, xd, out):
    """The GEMV arithmetic with one weight row per lane (AVX-512 VNNI): 8 x 1 rows tiles for
    decode, 16-row panels for more rows (matmul_tiling.many_rows); xa = -128 * each activation
    block's sum (the codes enter vpdpbusd as table value + 128)."""
    many_rows(fmt, GEMV, w, xqs, xd, _block_sums_32(xqs, -128), out)


_gemv = _gemv_rows if HAS_VNNI else _gemv_lanes


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq4_nl_q8_0_repacked(w, xqs, xd, out):
    """IQ4_NL with R % 8 == 0, repacked to iq4_nl_8x8: ggml_gemv / ggml_gemm_iq4_nl_8x8_q8_0,
    acc = fma(I, d_w * d_x, acc) per 32-value block (the GEMV tile)."""
    _gemv(_IQ4_NL, w, xqs, xd, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq4_xs_q8_k(w, xqs, xd, xbsums, out):
    """IQ4_XS weights x Q8_K: ggml_vec_dot_iq4_xs_q8_K (8 lanes of integer sums times the
    sub-block scales, one fma by d_w * d_x per 256 values) for T < 8, the tiled kernel (as the
    K-quants: r = S * d_w, acc = fma(r, d_x, acc) per 256 values) for T >= 8."""
    _plain_k(_IQ4_XS, NR_ROWS, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_mxfp4_q8_0(w, xqs, xd, out):
    """MXFP4 weights (plain buffer) x Q8_0: ggml_vec_dot_mxfp4_q8_0 (two accumulators) for every T."""
    _vec_dot_2acc(True, w, xqs, xd, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_mxfp4_q8_0_repacked(w, xqs, xd, out):
    """MXFP4 with R % 8 == 0, repacked to mxfp4_8x8: ggml_gemv / ggml_gemm_mxfp4_8x8_q8_0 (the GEMV tile)."""
    _gemv(_MXFP4, w, xqs, xd, out)


# batch-invariant variants (see matmul_kernels): llama.cpp's arithmetic for a batch of one row at every T


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq4_nl_q8_0_bi(w, xqs, xd, out):
    """IQ4_NL (plain buffer), batch-invariant: ggml_vec_dot_iq4_nl_q8_0 for every T."""
    _vec_dot_2acc(False, w, xqs, xd, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_iq4_xs_q8_k_bi(w, xqs, xd, xbsums, out):
    """IQ4_XS, batch-invariant: ggml_vec_dot_iq4_xs_q8_K (the VEC_DOT tile) for every T."""
    _tiled(_IQ4_XS, VEC_DOT, NR, w, xqs, xd, xbsums, out)
