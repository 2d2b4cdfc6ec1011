"""IQ2_XXS / IQ2_XS / IQ2_S / IQ3_XXS / IQ3_S x Q8_K matmul entry points, as llama.cpp's CPU
backend (AVX2) computes them; imported into kernels_cpu.matmul_kernels (shapes as there:
w uint8[R, row_bytes], xqs int8|int16[T, K], xd float32[T, K/256], xbsums int16[T, K/16]
(unused), out float32[T, R]).

On CPUs with AVX2 (kernels_cpu.simd.HAS_AVX2, AVX-512 CPUs included) they run the
vector tiles of kernels_cpu.iq23_avx2 through qdot_tile: ggml_vec_dot_iq*_q8_K (the VEC_DOT
tile) for T < 8, llama.cpp's tiled kernels (ggml-cpu/tiled, the TILED tile) for T >= 8, and the
``_bi`` (batch-invariant) kernels the VEC_DOT tile for every T. Elsewhere, kernels_cpu.iq23's
scalar numba kernels (same results).

numba's on-disk cache keys these kernels on this file only: after editing the modules they build
on (iq23_avx2, iq4_avx2, matmul_avx2, matmul_tiling, simd), clear kernels_cpu/__pycache__/iq23_kernels.*.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType
from numba import njit

from kernels_cpu import iq23
from kernels_cpu.matmul_tiles import TILED, VEC_DOT
from kernels_cpu.matmul_tiling import NR, _blocks, _tiled
from kernels_cpu.simd import HAS_AVX2

T_ = GGMLQuantizationType
_IQ2_XXS, _IQ2_XS, _IQ2_S = int(T_.IQ2_XXS), int(T_.IQ2_XS), int(T_.IQ2_S)
_IQ3_XXS, _IQ3_S = int(T_.IQ3_XXS), int(T_.IQ3_S)
AVX2_TYPES = frozenset({"iq3_s", "iq2_s", "iq3_xxs", "iq2_xxs", "iq2_xs"}) if HAS_AVX2 else frozenset()  # types on the vector tiles


@njit(cache=True, inline="always")
def _plain(fmt, w, xqs, xd, xbsums, out):
    """The TILED tile for T >= 8 (ggml_tiled_min_batch), else VEC_DOT (ND x 1 tiles for decode)."""
    if xqs.shape[0] >= 8:
        _blocks(fmt, TILED, NR, True, w, xqs, xd, xbsums, out)
    else:
        _tiled(fmt, VEC_DOT, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def _iq3_s(w, xqs, xd, xbsums, out):
    """IQ3_S x Q8_K: ggml_vec_dot_iq3_s_q8_K (AVX2) for T < 8, tiled for T >= 8."""
    _plain(_IQ3_S, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def _iq3_s_bi(w, xqs, xd, xbsums, out):
    """IQ3_S x Q8_K, batch-invariant: ggml_vec_dot_iq3_s_q8_K for every T."""
    _tiled(_IQ3_S, VEC_DOT, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def _iq2_s(w, xqs, xd, xbsums, out):
    """IQ2_S x Q8_K: ggml_vec_dot_iq2_s_q8_K (AVX2) for T < 8, tiled for T >= 8."""
    _plain(_IQ2_S, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def _iq2_s_bi(w, xqs, xd, xbsums, out):
    """IQ2_S x Q8_K, batch-invariant: ggml_vec_dot_iq2_s_q8_K for every T."""
    _tiled(_IQ2_S, VEC_DOT, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def _iq3_xxs(w, xqs, xd, xbsums, out):
    """IQ3_XXS x Q8_K: ggml_vec_dot_iq3_xxs_q8_K (AVX2) for T < 8, tiled for T >= 8."""
    _plain(_IQ3_XXS, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def _iq3_xxs_bi(w, xqs, xd, xbsums, out):
    """IQ3_XXS x Q8_K, batch-invariant: ggml_vec_dot_iq3_xxs_q8_K for every T."""
    _tiled(_IQ3_XXS, VEC_DOT, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def _iq2_xxs(w, xqs, xd, xbsums, out):
    """IQ2_XXS x Q8_K: ggml_vec_dot_iq2_xxs_q8_K (AVX2) for T < 8, tiled for T >= 8."""
    _plain(_IQ2_XXS, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def _iq2_xxs_bi(w, xqs, xd, xbsums, out):
    """IQ2_XXS x Q8_K, batch-invariant: ggml_vec_dot_iq2_xxs_q8_K for every T."""
    _tiled(_IQ2_XXS, VEC_DOT, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def _iq2_xs(w, xqs, xd, xbsums, out):
    """IQ2_XS x Q8_K: ggml_vec_dot_iq2_xs_q8_K (AVX2) for T < 8, tiled for T >= 8."""
    _plain(_IQ2_XS, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def _iq2_xs_bi(w, xqs, xd, xbsums, out):
    """IQ2_XS x Q8_K, batch-invariant: ggml_vec_dot_iq2_xs_q8_K for every T."""
    _tiled(_IQ2_XS, VEC_DOT, NR, w, xqs, xd, xbsums, out)


def _pick(name: str, fast, fast_bi):
    """(kernel, batch-invariant kernel) of type ``name``: the vector tiles' or kernels_cpu.iq23's."""
    if name in AVX2_TYPES:
        return fast, fast_bi
    return getattr(iq23, f"matmul_{name}_q8_k"), getattr(iq23, f"matmul_{name}_q8_k_bi")


matmul_iq3_s_q8_k, matmul_iq3_s_q8_k_bi = _pick("iq3_s", _iq3_s, _iq3_s_bi)
matmul_iq2_s_q8_k, matmul_iq2_s_q8_k_bi = _pick("iq2_s", _iq2_s, _iq2_s_bi)
matmul_iq3_xxs_q8_k, matmul_iq3_xxs_q8_k_bi = _pick("iq3_xxs", _iq3_xxs, _iq3_xxs_bi)
matmul_iq2_xxs_q8_k, matmul_iq2_xxs_q8_k_bi = _pick("iq2_xxs", _iq2_xxs, _iq2_xxs_bi)
matmul_iq2_xs_q8_k, matmul_iq2_xs_q8_k_bi = _pick("iq2_xs", _iq2_xs, _iq2_xs_bi)
