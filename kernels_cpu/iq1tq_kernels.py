"""IQ1_S / IQ1_M / TQ1_0 / TQ2_0 x Q8_K matmul entry points, as llama.cpp's CPU backend (AVX2)
computes them; imported into kernels_cpu.matmul_kernels (shapes as there: w uint8[R, row_bytes],
xqs int8|int16[T, K], xd float32[T, K/256], xbsums int16[T, K/16], out float32[T, R]).

On CPUs with AVX2 (kernels_cpu.simd.HAS_AVX2, with or without AVX-512: no other vector kernel
covers these types) they run the tiles of kernels_cpu.iq1tq_avx2 through qdot_tile: IQ1_S /
IQ1_M ggml_vec_dot_iq1_*_q8_K (the VEC_DOT tile) for T < 8 and llama.cpp's tiled matmul
(ggml-cpu/tiled, the TILED tile) for T >= 8, their ``_bi`` (batch-invariant) kernels VEC_DOT for
every T; TQ1_0 / TQ2_0 ggml_vec_dot_tq*_q8_K at every T. Elsewhere, kernels_cpu.iq1tq's scalar
numba kernels (same results).

numba's on-disk cache keys these kernels on this file only: after editing the modules they build
on (iq1tq_avx2, iq23_avx2, iq4_avx2, matmul_avx2, matmul_tiling, simd), clear
kernels_cpu/__pycache__/iq1tq_kernels.*.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType
from numba import njit

from kernels_cpu import iq1tq
from kernels_cpu.matmul_tiles import TILED, VEC_DOT
from kernels_cpu.matmul_tiling import NR, _blocks, _tiled
from kernels_cpu.simd import HAS_AVX2

T_ = GGMLQuantizationType
_IQ1_S, _IQ1_M, _TQ1_0, _TQ2_0 = int(T_.IQ1_S), int(T_.IQ1_M), int(T_.TQ1_0), int(T_.TQ2_0)
AVX2_TYPES = frozenset({"iq1_s", "iq1_m", "tq1_0", "tq2_0"}) if HAS_AVX2 else frozenset()  # types on the vector tiles


def _kernel(name: str, fmt: int, tiled: bool, doc: str):
    """A parallel kernel ``(w, xqs, xd, xbsums, out)`` of GGML type ``fmt``: qdot_tile's TILED tile
    for T >= 8 (ggml_tiled_min_batch) when ``tiled``, else VEC_DOT (ND x 1 tiles for decode).
    numba caches each on disk apart (its key holds the closure's values)."""

    def vec_dot(w, xqs, xd, xbsums, out):
        _tiled(fmt, VEC_DOT, NR, w, xqs, xd, xbsums, out)

    def plain(w, xqs, xd, xbsums, out):
        if xqs.shape[0] >= 8:
            _blocks(fmt, TILED, NR, True, w, xqs, xd, xbsums, out)
        else:
            _tiled(fmt, VEC_DOT, NR, w, xqs, xd, xbsums, out)

    kernel = plain if tiled else vec_dot

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = doc
    return njit(parallel=True, cache=True, nogil=True)(kernel)


_iq1_s = _kernel("_iq1_s", _IQ1_S, True, "IQ1_S x Q8_K: ggml_vec_dot_iq1_s_q8_K (AVX2) for T < 8, tiled for T >= 8.")
_iq1_s_bi = _kernel("_iq1_s_bi", _IQ1_S, False, "IQ1_S x Q8_K, batch-invariant: ggml_vec_dot_iq1_s_q8_K for every T.")
_iq1_m = _kernel("_iq1_m", _IQ1_M, True, "IQ1_M x Q8_K: ggml_vec_dot_iq1_m_q8_K (AVX2) for T < 8, tiled for T >= 8.")
_iq1_m_bi = _kernel("_iq1_m_bi", _IQ1_M, False, "IQ1_M x Q8_K, batch-invariant: ggml_vec_dot_iq1_m_q8_K for every T.")
_tq1_0 = _kernel("_tq1_0", _TQ1_0, False, "TQ1_0 x Q8_K: ggml_vec_dot_tq1_0_q8_K (AVX2) for every T.")
_tq2_0 = _kernel("_tq2_0", _TQ2_0, False, "TQ2_0 x Q8_K: ggml_vec_dot_tq2_0_q8_K (AVX2) for every T.")


def _pick(name: str, fast, fast_bi=None):
    """(kernel, batch-invariant kernel or None) of type ``name``: the vector tiles' or kernels_cpu.iq1tq's."""
    if name in AVX2_TYPES:
        return fast, fast_bi
    return getattr(iq1tq, f"matmul_{name}_q8_k"), getattr(iq1tq, f"matmul_{name}_q8_k_bi", None)


matmul_iq1_s_q8_k, matmul_iq1_s_q8_k_bi = _pick("iq1_s", _iq1_s, _iq1_s_bi)
matmul_iq1_m_q8_k, matmul_iq1_m_q8_k_bi = _pick("iq1_m", _iq1_m, _iq1_m_bi)
matmul_tq1_0_q8_k = _pick("tq1_0", _tq1_0)[0]
matmul_tq2_0_q8_k = _pick("tq2_0", _tq2_0)[0]
