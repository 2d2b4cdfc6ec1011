"""The per-type matmul kernels (numba entry points, compiled once and cached on disk) and the
choice among them, as llama.cpp's CPU backend chooses (see kernels_cpu.matmul).

Kernel names follow the type table (kernels_cpu.ggml_types): ``matmul_<type>_<vec_dot_type>``
for llama.cpp's plain CPU buffer, ``..._repacked`` for the weights it repacks, ``..._bi`` /
``..._repacked_bi`` for the batch-invariant variants where one exists.

Shapes: w uint8[R, row_bytes], xqs int8[T, K] or int16[T, K] (the same quants widened, read
with one load per segment), xd float32[T, K/block], xs float32[T, K/32], xbsums int16[T, K/16],
out float32[T, R]; all C-contiguous.

numba's on-disk cache keys these kernels on this file only: after editing the modules they
build on (matmul_decoders, matmul_tiles, matmul_tiling, matmul_rows, matmul_vnni, matmul_avx2,
kquant_int8), clear
kernels_cpu/__pycache__/matmul_kernels.*.nbi / .nbc.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit, prange

from kernels_cpu.f16 import f16_to_f32, f32_to_f16
from kernels_cpu.ggml_types import QUANTIZED_TYPES, TYPES, kernels
from kernels_cpu.iq1tq_kernels import (matmul_iq1_m_q8_k, matmul_iq1_m_q8_k_bi, matmul_iq1_s_q8_k,  # noqa: F401
                                       matmul_iq1_s_q8_k_bi, matmul_tq1_0_q8_k, matmul_tq2_0_q8_k)
from kernels_cpu.iq1tq_kernels import AVX2_TYPES as IQ1TQ_AVX2_TYPES
from kernels_cpu.iq23_kernels import (matmul_iq2_s_q8_k, matmul_iq2_s_q8_k_bi, matmul_iq2_xs_q8_k,  # noqa: F401
                                      matmul_iq2_xs_q8_k_bi, matmul_iq2_xxs_q8_k, matmul_iq2_xxs_q8_k_bi,
                                      matmul_iq3_s_q8_k, matmul_iq3_s_q8_k_bi, matmul_iq3_xxs_q8_k,
                                      matmul_iq3_xxs_q8_k_bi)
from kernels_cpu.iq23_kernels import AVX2_TYPES as IQ23_AVX2_TYPES
from kernels_cpu.matmul_float import matmul_bf16_bf16, matmul_f16_f16, matmul_f32_f32  # noqa: F401
from kernels_cpu.matmul_rows import Q0_ROWS
from kernels_cpu.matmul_tiles import GEMM, GEMV, TILED, VEC_DOT
from kernels_cpu.matmul_tiling import (ND_Q6_K, NR, NR_Q0, NR_ROWS, NT_WIDE, PANEL_ROWS, _block_sums_32, _blocks,
                                      _panels, _rows, _tiled, kq_rows, many_rows)
from kernels_cpu.simd import HAS_AVX2, HAS_DOTPROD, HAS_INT8_VEC_DOT, HAS_VNNI

T_ = GGMLQuantizationType

_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0 = int(T_.Q4_0), int(T_.Q4_1), int(T_.Q5_0), int(T_.Q5_1), int(T_.Q8_0)
_Q2_K, _Q3_K, _Q4_K, _Q5_K, _Q6_K = int(T_.Q2_K), int(T_.Q3_K), int(T_.Q4_K), int(T_.Q5_K), int(T_.Q6_K)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q4_0_q8_0(w, xqs, xd, out):
    """Q4_0 weights x Q8_0 activations (ggml_vec_dot_q4_0_q8_0, tinyBLAS_Q0_AVX)."""
    _tiled(_Q4_0, VEC_DOT, NR, w, xqs, xd, xd, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q4_0_q8_0_repacked(w, xqs, xd, out):
    """Q4_0 weights with R % 8 == 0, repacked by llama.cpp to q4_0_8x8: ggml_gemv and
    ggml_gemm_q4_0_8x8_q8_0 share the GEMV structure (one fma of the block's integer total
    per 32 values). With AVX-512 VNNI: the rows tiles (kernels_cpu.matmul_rows: codes 0..15, from
    -8 * each activation block's sum), int8 quants."""
    if HAS_VNNI:
        many_rows(_Q4_0, GEMV, w, xqs, xd, _block_sums_32(xqs, _Q4_0_NEG_OFFSET), out)
    else:
        _tiled(_Q4_0, GEMV, NR, w, xqs, xd, xd, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q5_0_q8_0(w, xqs, xd, out):
    """Q5_0 weights x Q8_0 activations (ggml_vec_dot_q5_0_q8_0, tinyBLAS_Q0_AVX)."""
    _tiled(_Q5_0, VEC_DOT, NR_Q0, w, xqs, xd, xd, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q8_0_q8_0(w, xqs, xd, out):
    """Q8_0 weights x Q8_0 activations (ggml_vec_dot_q8_0_q8_0, tinyBLAS_Q0_AVX)."""
    _tiled(_Q8_0, VEC_DOT, NR_Q0, w, xqs, xd, xd, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q4_1_q8_1(w, xqs, xd, xs, out):
    """Q4_1 weights x Q8_1 activations (ggml_vec_dot_q4_1_q8_1)."""
    _tiled(_Q4_1, VEC_DOT, NR, w, xqs, xd, xs, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q5_1_q8_1(w, xqs, xd, xs, out):
    """Q5_1 weights x Q8_1 activations (ggml_vec_dot_q5_1_q8_1)."""
    _tiled(_Q5_1, VEC_DOT, NR, w, xqs, xd, xs, out)


@njit(cache=True, inline="always")
def _plain_k(fmt, nr, nd, w, xqs, xd, xbsums, out):
    """K-quant weights in llama.cpp's plain CPU buffer: the tiled kernel for batches of >= 8
    rows (ggml_tiled_min_batch) in tiles of ``nr`` weight rows, else ggml_vec_dot_<type>_q8_K
    in tiles of ``nd`` rows."""
    if xqs.shape[0] >= 8:
        _blocks(fmt, TILED, nr, True, w, xqs, xd, xbsums, out)
    else:
        _tiled(fmt, VEC_DOT, nd, w, xqs, xd, xbsums, out)


@njit(cache=True, inline="always")
def _repacked_k(fmt, nr, w, xqs, xd, xbsums, out):
    """Q4_K / Q2_K weights with a multiple of 8 rows, which llama.cpp repacks (CPU_REPACK,
    ggml_repack_get_optimal_repack_type): the first T - T % 4 activation rows (when T > 3) by
    ggml_gemm_<type>_8x8_q8_K, the others by ggml_gemv_<type>_8x8_q8_K
    (tensor_traits::forward_mul_mat_one_chunk)."""
    T = xqs.shape[0]
    n4 = T - T % 4 if T > 3 else 0
    if n4 > 0:  # R % 8 == 0 and n4 % NT == 0: whole NR x NT tiles
        _blocks(fmt, GEMM, nr, False, w, xqs[:n4], xd[:n4], xbsums[:n4], out[:n4])
    if n4 < T:
        _rows(fmt, GEMV, nr, w, xqs[n4:], xd[n4:], xbsums[n4:], out[n4:])


@njit(cache=True, inline="always")
def _plain_k_panels(fmt, w, xqs, xd, xbsums, out):
    """_plain_k with the tiled kernel in 16-row panels (kernels_cpu.matmul_panel, AVX-512 VNNI,
    same bits) when R >= 16."""
    if xqs.shape[0] >= 8 and w.shape[0] >= PANEL_ROWS:
        _panels(fmt, TILED, w, xqs, xd, xbsums, out)
    else:
        _plain_k(fmt, NR, NR, w, xqs, xd, xbsums, out)


@njit(cache=True, inline="always")
def _plain_k_tiles(fmt, w, xqs, xd, xbsums, out):
    """_plain_k in NR-row tiles (CPUs without AVX-512 VNNI)."""
    _plain_k(fmt, NR, NR, w, xqs, xd, xbsums, out)


_plain_k_fast = _plain_k_panels if HAS_VNNI else _plain_k_tiles  # Q4_K (R % 8 != 0) and Q5_K


@njit(cache=True, inline="always")
def _repacked_q4_k(w, xqs, xd, xbsums, out):
    """_repacked_k for Q4_K, every part through matmul_tiling.kq_rows (many_rows with AVX-512
    VNNI: 16-row panels for T >= 2; 8-row tiles of kernels_cpu.kquant_int8 with AVX2 or DotProd;
    same arithmetic)."""
    T = xqs.shape[0]
    n4 = T - T % 4 if T > 3 else 0
    if n4 > 0:
        kq_rows(_Q4_K, GEMM, w, xqs[:n4], xd[:n4], xbsums[:n4], out[:n4])
    if n4 < T:
        kq_rows(_Q4_K, GEMV, w, xqs[n4:], xd[n4:], xbsums[n4:], out[n4:])


@njit(cache=True, inline="always")
def _plain_q6_k(w, xqs, xd, xbsums, out):
    """_plain_k for Q6_K: the tiled kernel through matmul_tiling.many_rows for T >= 8, else
    VEC_DOT in tiles of ND_Q6_K rows."""
    if xqs.shape[0] >= 8:
        many_rows(_Q6_K, TILED, w, xqs, xd, xbsums, out)
    else:
        _tiled(_Q6_K, VEC_DOT, ND_Q6_K, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q2_k_q8_k(w, xqs, xd, xbsums, out):
    """Q2_K weights x Q8_K activations (see _plain_k)."""
    _plain_k(_Q2_K, NR, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q2_k_q8_k_repacked(w, xqs, xd, xbsums, out):
    """Q2_K weights with R % 8 == 0 (see _repacked_k)."""
    _repacked_k(_Q2_K, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q3_k_q8_k(w, xqs, xd, xbsums, out):
    """Q3_K weights x Q8_K activations (see _plain_k)."""
    _plain_k(_Q3_K, NR, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q4_k_q8_k(w, xqs, xd, xbsums, out):
    """Q4_K weights x Q8_K activations (see _plain_k)."""
    _plain_k_fast(_Q4_K, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q4_k_q8_k_repacked(w, xqs, xd, xbsums, out):
    """Q4_K weights with R % 8 == 0 (see _repacked_k, _repacked_q4_k)."""
    _repacked_q4_k(w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q5_k_q8_k(w, xqs, xd, xbsums, out):
    """Q5_K weights x Q8_K activations (see _plain_k)."""
    _plain_k_fast(_Q5_K, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q6_k_q8_k(w, xqs, xd, xbsums, out):
    """Q6_K weights x Q8_K activations (see _plain_k, _plain_q6_k)."""
    _plain_q6_k(w, xqs, xd, xbsums, out)


# float weights: kernels_cpu.matmul_float (one summation order on every CPU)


@njit(cache=True, nogil=True)
def round_to_f16(x, out):
    """out = float32(f16(x)), round to nearest even (ggml_cpu_fp32_to_fp16). Shapes: f32[T, K]."""
    for t in range(x.shape[0]):
        for k in range(x.shape[1]):
            out[t, k] = f16_to_f32(f32_to_f16(x[t, k]))


@njit(cache=True, nogil=True)
def round_to_bf16(x, out):
    """out = float32(bf16(x)) as ggml_compute_fp32_to_bf16: nearest even, NaN made quiet. f32[T, K]."""
    bits_in = x.view(np.uint32)
    bits_out = out.view(np.uint32)
    for t in range(x.shape[0]):
        for k in range(x.shape[1]):
            u = bits_in[t, k]
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                h = (u >> np.uint32(16)) | np.uint32(64)
            else:
                h = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
            bits_out[t, k] = (h & np.uint32(0xFFFF)) << np.uint32(16)


# Batch-invariant kernels: every activation row gets the arithmetic llama.cpp gives a batch of
# one row (GEMV for repacked weights, VEC_DOT for the others), whatever T is, in multi-row
# tiles. A row's result then depends on that row alone, not on the batch it is computed in
# (the server's requirement: a request's text must not depend on what else is being served).
# Q5_0 / Q8_0 instead take the GEMV structure at every T and Q6_K llama.cpp's tiled kernel
# (faster in batches than their VEC_DOT, last bits not llama.cpp's for one row). Other types'
# llama.cpp paths are already one arithmetic for every T.


@njit(parallel=True, cache=True, nogil=True)
def matmul_q2_k_q8_k_bi(w, xqs, xd, xbsums, out):
    """Q2_K, batch-invariant (VEC_DOT for every T)."""
    _tiled(_Q2_K, VEC_DOT, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q2_k_q8_k_repacked_bi(w, xqs, xd, xbsums, out):
    """Q2_K repacked, batch-invariant (GEMV for every T)."""
    _tiled(_Q2_K, GEMV, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q3_k_q8_k_bi(w, xqs, xd, xbsums, out):
    """Q3_K, batch-invariant (VEC_DOT for every T)."""
    _tiled(_Q3_K, VEC_DOT, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q4_k_q8_k_bi(w, xqs, xd, xbsums, out):
    """Q4_K, batch-invariant (VEC_DOT for every T)."""
    _tiled(_Q4_K, VEC_DOT, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q4_k_q8_k_repacked_bi(w, xqs, xd, xbsums, out):
    """Q4_K repacked, batch-invariant (GEMV for every T)."""
    kq_rows(_Q4_K, GEMV, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q5_k_q8_k_bi(w, xqs, xd, xbsums, out):
    """Q5_K, batch-invariant (VEC_DOT for every T)."""
    _tiled(_Q5_K, VEC_DOT, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q6_k_q8_k_bi(w, xqs, xd, xbsums, out):
    """Q6_K, batch-invariant: the tiled kernel's arithmetic (llama.cpp's for T >= 8) for every T.
    One activation row with AVX-512 VNNI: kernels_cpu.kquant_int8's tiles of ND_Q6_K rows (the
    8-row VNNI tile read 8 far-apart rows per tile, 25 against 38 GB/s on long rows)."""
    if HAS_VNNI and xqs.shape[0] == 1:
        _rows(_Q6_K, TILED, ND_Q6_K, w, xqs, xd, xbsums, out)
    else:
        many_rows(_Q6_K, TILED, w, xqs, xd, xbsums, out)


_Q5_0_NEG_OFFSET, _Q8_0_NEG_OFFSET = -Q0_ROWS["Q5_0"][1], -Q0_ROWS["Q8_0"][1]  # matmul_rows' unsigned codes
_Q4_0_NEG_OFFSET = -Q0_ROWS["Q4_0"][1]


@njit(parallel=True, cache=True, nogil=True)
def matmul_q5_0_q8_0_bi(w, xqs, xd, out):
    """Q5_0, batch-invariant and faster than llama.cpp's VEC_DOT: GEMV structure (one float
    update of the exact block total per 32 values), VNNI tiles with one weight row per lane
    (kernels_cpu.matmul_rows, which take the activation quant sums of each block)."""
    many_rows(_Q5_0, GEMV, w, xqs, xd, _block_sums_32(xqs, _Q5_0_NEG_OFFSET), out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q8_0_q8_0_bi(w, xqs, xd, out):
    """Q8_0, batch-invariant (see matmul_q5_0_q8_0_bi)."""
    many_rows(_Q8_0, GEMV, w, xqs, xd, _block_sums_32(xqs, _Q8_0_NEG_OFFSET), out)


from kernels_cpu.iq4_kernels import (matmul_iq4_nl_q8_0, matmul_iq4_nl_q8_0_bi,  # noqa: F401
                                     matmul_iq4_nl_q8_0_repacked, matmul_iq4_xs_q8_k, matmul_iq4_xs_q8_k_bi,
                                     matmul_mxfp4_q8_0, matmul_mxfp4_q8_0_repacked)

# types whose kernels take int8 activation quants: the VNNI kernels, the AVX2 vpmaddubsw tiles
ROWS_TYPES = ((T_.Q4_0, T_.Q5_0, T_.Q8_0, T_.Q4_K, T_.Q5_K, T_.Q6_K) if HAS_VNNI else (T_.Q5_0, T_.Q8_0) if HAS_INT8_VEC_DOT
              else ())
ROWS_TYPES += (T_.Q4_1, T_.Q5_1) if HAS_AVX2 or HAS_DOTPROD else ()  # matmul_avx2 tiles
ROWS_TYPES += (T_.Q2_K, T_.Q3_K, T_.Q4_K, T_.Q5_K, T_.Q6_K) if HAS_INT8_VEC_DOT else ()  # kquant_int8 tiles
ROWS_TYPES += (T_.IQ4_NL, T_.IQ4_XS, T_.MXFP4) if HAS_AVX2 else ()  # iq4_avx2 tiles
ROWS_TYPES += tuple(T_[name.upper()] for name in sorted(IQ23_AVX2_TYPES | IQ1TQ_AVX2_TYPES))  # iq23_avx2, iq1tq_avx2

_REPACKED_TYPES = tuple(t for t in QUANTIZED_TYPES if TYPES[t].repacked)
QUANT_KERNELS = kernels(globals(), "matmul", types=QUANTIZED_TYPES)  # llama.cpp's plain CPU buffer
# weights llama.cpp repacks on x86 (ggml_repack_get_optimal_repack_type), R % 8 == 0
REPACKED_KERNELS = kernels(globals(), "matmul", "_repacked", types=_REPACKED_TYPES)
BATCH_INVARIANT_KERNELS = kernels(globals(), "matmul", "_bi", types=QUANTIZED_TYPES, optional=True)
BATCH_INVARIANT_REPACKED = kernels(globals(), "matmul", "_repacked_bi", types=_REPACKED_TYPES, optional=True)


def quant_kernel(t: GGMLQuantizationType, n_rows: int, batch_invariant: bool = False):
    """The per-type kernel llama.cpp's choice calls for: REPACKED_KERNELS[t] when t is repacked
    and n_rows % 8 == 0, else QUANT_KERNELS[t] (separate functions, so that a process compiles
    only the paths its matrices take). ``batch_invariant``: the kernel whose arithmetic does not
    depend on the number of rows (BATCH_INVARIANT_*; see matmul), where llama.cpp's does or
    where a faster one exists (Q5_0 / Q8_0)."""
    repacked = n_rows % 8 == 0 and t in REPACKED_KERNELS
    if batch_invariant:
        kernel = (BATCH_INVARIANT_REPACKED if repacked else BATCH_INVARIANT_KERNELS).get(t)
        if kernel is not None:
            return kernel
    return REPACKED_KERNELS[t] if repacked else QUANT_KERNELS[t]
