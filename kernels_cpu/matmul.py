"""Quantized matrix multiplication: out[t, r] = sum_k W[r, k] * x[t, k], bit for bit as llama.cpp's CPU backend.

x is first converted to the weight type's ``vec_dot_type`` (ggml-cpu.c ``type_traits_cpu``):

    Q4_0, Q5_0, Q8_0 -> Q8_0      Q4_1, Q5_1 -> Q8_1      Q2_K .. Q6_K -> Q8_K
    F16 -> x rounded to f16       BF16 -> x rounded to bf16       F32 -> x as is

Integer products are exact in every ggml kernel, so a result is fixed by which integer sums
become floats, the float scales they meet and the order of the float operations. For each
weight type and batch size T, llama.cpp (x86-64, AVX-512 VNNI build, CPU_REPACK and tiled
matmul on) runs one of these kernels; each ``path`` here reproduces its float structure:

VEC_DOT  ggml_vec_dot_<type>_<vec_dot_type> (arch/x86/quants.c, AVX2 code), and for Q4_0/Q5_0/
         Q8_0 batches of T >= 2 llamafile's tinyBLAS_Q0_AVX (same structure): 8 float lanes per
         output; per block lane j gets the integer sum of values 4j..4j+3 of every 32-value
         segment (times their sub-block scales) through acc = fma(d_w * d_x, lane, acc); the
         result is hsum_float_8 = ((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7)). Per type: Q4_1/Q5_1 add
         a fma chain of m * s; Q6_K lanes use codes 0..63 minus 32 * scale * bsums; Q4_K adds
         4 lanes of mins * bsums (scale -d_x * dmin), Q5_K a scalar fma chain of them, Q2_K puts
         them first into the same 8 lanes. Used for Q4_0..Q5_1 always, K-quants when T < 8.
TILED    tiled_run_micro_vnni_8x16 (tiled/tiled-kernel.cpp), K-quants with T >= 8 that are not
         repacked: per super-block exact totals S1 (and mins S2); r = S1 * d_w, r = fma(-dmin,
         S2, r); acc = fma(r, d_x, acc).
GEMV     ggml_gemv_{q4_K,q2_K}_8x8_q8_K (arch/x86/repack.cpp): Q4_K / Q2_K with R % 8 == 0 are
GEMM     repacked; activation rows [0, T - T % 4) (T > 3) go through the gemm, the rest through
         the gemv. Per group of values (gemv: 256; gemm: 64 for Q4_K, 128 for Q2_K) acc =
         fma(I, d_w * d_x, acc) and accm = fma(M, dmin * d_x, accm); out = acc - accm. Q4_0 with
         R % 8 == 0 is repacked too (q4_0_8x8): gemv and gemm both take acc = fma(I, d_w * d_x,
         acc) per 32-value block (GEMV here).

Layers, bottom up: kernels_cpu.matmul_decoders (IR decoders of each weight block, layouts from
the type table kernels_cpu.ggml_types), kernels_cpu.matmul_tiles (the generic tile: each weight
block unpacked once into int16 segments, multiplied pairwise with the activations, the integer
sums packed down to the lanes of the path), kernels_cpu.matmul_tiling (the ``qdot_tile``
intrinsic that calls a generated tile, and the loops that tile a matmul: NR x NT tiles for
T >= NT over chunks of TC activation rows, ND x 1 tiles R // ND rows apart for decode),
kernels_cpu.matmul_kernels (the per-type numba entry points and the choice among them), and
this module (the activation workspace and :func:`matmul`). Results do not depend on the tiling.

On CPUs with AVX-512 VNNI (simd.HAS_VNNI) some tiles come from other generators, with the
same float operations: Q4_K (repacked) and Q6_K (tiled) from kernels_cpu.matmul_rows (one
weight row per lane), Q5_0 / Q8_0 and Q6_K on the VEC_DOT path from kernels_cpu.matmul_vnni
(vpdpbusd / vpmaddubsw + vpdpwssd straight into ggml's 8 lanes); those types take int8 quants.
For two or more activation rows, the one-row-per-lane types (Q4_K GEMV / GEMM, Q6_K TILED and
the GEMV path of Q8_0 / Q5_0 / Q4_0 / IQ4_NL / MXFP4) run in 16-row panels instead
(kernels_cpu.matmul_panel: each weight block decoded once for all the rows; same bits).
On AVX2 CPUs without VNNI and arm64 CPUs with DotProd (simd.HAS_INT8_VEC_DOT), Q4_0 / Q5_0 / Q8_0
on the VEC_DOT path come from kernels_cpu.matmul_avx2 (vpmaddubsw + vpmaddwd, or sdot, into the
same 8 lanes); Q5_0 / Q8_0 take int8 quants. There the K-quants Q2_K .. Q6_K come from
kernels_cpu.kquant_int8 on every path (same float operations; int8 quants): one weight row per
vector (vpmaddubsw + vpmaddwd with the group scales, or sdot, into ggml's 8 lanes, added across
lanes for TILED / GEMV / GEMM), Q4_K GEMV / GEMM (repacked) in 8-row tiles with one row per
lane (kernels_cpu.matmul_rows' layout, matmul_tiling.kq_rows). On every CPU with AVX2 or DotProd, Q4_1 / Q5_1 come
from kernels_cpu.matmul_avx2 too; on every CPU with AVX2 (simd.HAS_AVX2), IQ4_NL /
IQ4_XS / MXFP4 from kernels_cpu.iq4_avx2, the IQ2 / IQ3 types from kernels_cpu.iq23_avx2 and IQ1_S /
IQ1_M / TQ1_0 / TQ2_0 from kernels_cpu.iq1tq_avx2 (with VNNI instructions where the CPU has them,
and on AVX-512 VNNI GEMV-path IQ4_NL / MXFP4 / Q4_0 and TILED-path IQ4_XS from
kernels_cpu.matmul_rows); they take int8 quants.

F32/F16/BF16 weights: tinyBLAS's order for one output on AVX-512 F (16 fma lanes, then their
halves tree; kernels_cpu.matmul_float), the same bits on every CPU; llama.cpp's own results
depend on its build and path (ggml_vec_dot_f16, AVX-512 BF16's dot products), so they agree
to float32 rounding.

Shapes everywhere: w uint8[R, row_bytes] (GGUFFile.tensor_rows), x float32[T, K], out
float32[T, R]; per-type kernels take the quantized activations (see quantize_act).
"""
from __future__ import annotations

import functools

import numpy as np
from gguf import GGMLQuantizationType

from kernels_cpu import quantize_act as qa
from kernels_cpu.dequant import QuantFormatError, as_ggml_type
from kernels_cpu.ggml_types import TYPES
from kernels_cpu.matmul_kernels import (ROWS_TYPES, matmul_bf16_bf16, matmul_f16_f16, matmul_f32_f32,
                                        quant_kernel, round_to_bf16, round_to_f16)

T_ = GGMLQuantizationType


class MatmulWorkspace:
    """Preallocated activation buffers for matmul, so a decode loop allocates nothing.

    Holds room for up to ``max_tokens`` rows of up to ``max_k`` values in every activation format
    (quants as int8 and widened to int16, scales, Q8_1 sums, Q8_K bsums, f16/bf16-rounded x). One workspace
    serves one thread of calls: matmul overwrites it on every call.
    """

    def __init__(self, max_tokens: int, max_k: int):
        if max_tokens < 1 or max_k < 1:
            raise ValueError(f"workspace needs max_tokens >= 1 and max_k >= 1, got {max_tokens}, {max_k}")
        self.max_tokens, self.max_k = max_tokens, max_k
        n = max_tokens * max_k
        self._buffers = {"qs16": np.empty(n, np.int16), "qs8": np.empty(n, np.int8),
                         "d": np.empty(n // 32 + 1, np.float32), "s": np.empty(n // 32 + 1, np.float32),
                         "bsums": np.empty(n // 16 + 1, np.int16), "x": np.empty(n, np.float32)}
        self._views: dict[tuple[str, int, int], np.ndarray] = {}

    def take(self, name: str, shape: tuple[int, int], dtype=None) -> np.ndarray:
        """A C-contiguous view of buffer ``name`` ('qs16', 'qs8', 'd', 's', 'bsums', 'x') with ``shape``.

        ``dtype`` is accepted for symmetry with allocation and ignored (each buffer has its own).
        """
        key = (name, shape[0], shape[1])
        view = self._views.get(key)
        if view is None:
            T, K = shape
            buf = self._buffers[name]
            if T > self.max_tokens or K > self.max_k or T * K > buf.size:
                raise ValueError(f"workspace holds {self.max_tokens} x {self.max_k} values, asked for {T} x {K}")
            view = self._views[key] = buf[: T * K].reshape(T, K)
        return view


def _check_matmul(w, t: GGMLQuantizationType, x, out):
    if not isinstance(w, np.ndarray) or w.dtype != np.uint8 or w.ndim != 2 or not w.flags.c_contiguous:
        raise QuantFormatError(f"w must be C-contiguous uint8[R, row_bytes] rows, got "
                               f"{getattr(w, 'dtype', type(w))} {getattr(w, 'shape', '')}")
    block_size, type_size = TYPES[t].block_size, TYPES[t].type_size
    if w.shape[1] % type_size or w.shape[0] == 0 or w.shape[1] == 0:
        raise QuantFormatError(f"w rows of {w.shape[1]} bytes are not whole {t.name} blocks ({type_size} bytes)")
    k = w.shape[1] // type_size * block_size
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        raise QuantFormatError(f"x must be C-contiguous float32[T, K], got {getattr(x, 'dtype', type(x))} "
                               f"{getattr(x, 'shape', '')}")
    if x.shape[0] < 1 or x.shape[1] != k:
        raise QuantFormatError(f"x has shape {x.shape}, expected [T >= 1, {k}] for {t.name} rows of {k} values")
    shape = (x.shape[0], w.shape[0])
    if out is None:
        return np.empty(shape, np.float32)
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != shape
            or not out.flags.c_contiguous or not out.flags.writeable):
        raise QuantFormatError(f"out must be a writeable C-contiguous float32{list(shape)}, got "
                               f"{getattr(out, 'dtype', type(out))} {getattr(out, 'shape', '')}")
    return out


_FLOAT_TYPES = frozenset((T_.F32, T_.F16, T_.BF16))
_TYPES: dict = {}  # the ggml_type argument as given (enum, int or name) -> GGMLQuantizationType


def _allocate(name: str, shape: tuple[int, int], dtype) -> np.ndarray:
    return np.empty(shape, dtype)


class QuantizedActivations:
    """Activations x f32[T, K] converted once to a weight type's vec_dot_type (Q8_0 / Q8_1 /
    Q8_K blocks), for several matmuls that read the same x (Q, K and V; gate and up).

    ``key`` names the format (activation format, int8 or int16 quants); ``arrays`` are the
    per-type kernel's activation arguments (quants, scales, and sums or bsums). Built by
    :func:`quantize_activations`; valid until the workspace it lives in is reused.
    """

    __slots__ = ("key", "shape", "arrays")

    def __init__(self, key: tuple, shape: tuple[int, int], arrays: tuple):
        self.key, self.shape, self.arrays = key, shape, arrays


@functools.lru_cache(maxsize=None)
def _act_key(t: GGMLQuantizationType) -> tuple:
    return TYPES[t].vec_dot_type, t in ROWS_TYPES


def _quantize(t: GGMLQuantizationType, x: np.ndarray, buf) -> QuantizedActivations:
    # the quantize kernels are called directly: x and every buffer are valid by construction.
    # The quants are int8 for the VNNI row kernels, else widened to int16: one load per segment
    # instead of load + extend (5-9% faster decode), one compiled specialization per type.
    T, K = x.shape
    key = _act_key(t)
    act, int8 = key
    qs = buf("qs8", (T, K), np.int8) if int8 else buf("qs16", (T, K), np.int16)
    if act == T_.Q8_K:
        d, bsums = buf("d", (T, K // 256), np.float32), buf("bsums", (T, K // 16), np.int16)
        qa.quantize_q8_k_kernel(x, qs, d, bsums)
        arrays = (qs, d, bsums)
    elif act == T_.Q8_1:
        d, s = buf("d", (T, K // 32), np.float32), buf("s", (T, K // 32), np.float32)
        qa.quantize_q8_1_kernel(x, qs, d, s)
        arrays = (qs, d, s)
    else:
        d = buf("d", (T, K // 32), np.float32)
        qa.quantize_q8_0_kernel(x, qs, d)
        arrays = (qs, d)
    return QuantizedActivations(key, (T, K), arrays)


def quantize_activations(ggml_type, x: np.ndarray, workspace: MatmulWorkspace | None = None):
    """x f32[T, K] (C-contiguous) in the vec_dot_type of ``ggml_type`` weights, as llama.cpp
    converts src1 before a quantized matmul (quantize_row_q8_0 / q8_1 / q8_K): a
    :class:`QuantizedActivations` to pass to :func:`matmul` as ``xq`` for every weight of a type
    with the same activation format; None for F32/F16/BF16 weights (nothing to share).
    Raises QuantFormatError for a bad x or type, ValueError when the workspace is too small.
    """
    t = _TYPES.get(ggml_type)
    if t is None:
        t = _TYPES[ggml_type] = as_ggml_type(ggml_type)
    if t in (T_.F32, T_.F16, T_.BF16):
        return None
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        raise QuantFormatError(f"x must be C-contiguous float32[T, K], got {getattr(x, 'dtype', type(x))} "
                               f"{getattr(x, 'shape', '')}")
    if x.shape[1] % TYPES[t].block_size:
        raise QuantFormatError(f"x rows of {x.shape[1]} values are not whole {t.name} blocks")
    return _quantize(t, x, workspace.take if workspace is not None else _allocate)


def matmul(w: np.ndarray, ggml_type, x: np.ndarray, out: np.ndarray | None = None,
           workspace: MatmulWorkspace | None = None, xq: QuantizedActivations | None = None,
           batch_invariant: bool = False) -> np.ndarray:
    """out[t, r] = sum_k W[r, k] * x[t, k] with W stored as GGML ``ggml_type`` rows, as llama.cpp.

    Shapes: w uint8[R, row_bytes] (zero-copy GGUF rows, also for F32/F16/BF16), x float32[T, K]
    with T >= 1, out float32[T, R] (allocated when None). ``workspace`` supplies the quantized
    activation buffers (else they are allocated). ``xq``: x already quantized by
    :func:`quantize_activations` (used when its format is this type's, else x is quantized
    anew, outside the workspace so that xq stays valid). Raises QuantFormatError for an
    unsupported type or mismatched shapes/dtypes (K-quant rows need K % 256 == 0), ValueError
    when the workspace is too small. Python-side cost is a few microseconds per call.
    ``batch_invariant``: row t of out depends on x[t] alone, bit for bit, whatever T is: K-quants
    get llama.cpp's arithmetic for a batch of one (quant_kernel); Q5_0 / Q8_0 get the GEMV
    structure of llama.cpp's repacked q4_0 (one float update per block), faster than their
    VEC_DOT at every T but not bit-equal to llama.cpp's. Without it, llama.cpp switches K-quant
    kernels at T >= 4 (repacked) or T >= 8, which changes the last bits.
    """
    t = _TYPES.get(ggml_type)
    if t is None:
        t = _TYPES[ggml_type] = as_ggml_type(ggml_type)
    out = _check_matmul(w, t, x, out)
    T, K = x.shape
    buf = workspace.take if workspace is not None and xq is None else _allocate
    if t not in _FLOAT_TYPES:
        if xq is None or xq.key != _act_key(t) or xq.shape != (T, K):
            xq = _quantize(t, x, buf)
        quant_kernel(t, w.shape[0], batch_invariant)(w, *xq.arrays, out)
    elif t == T_.F32:
        matmul_f32_f32(w.view(np.float32), x, out)
    else:
        xr = buf("x", (T, K), np.float32)
        (round_to_f16 if t == T_.F16 else round_to_bf16)(x, xr)
        (matmul_f16_f16 if t == T_.F16 else matmul_bf16_bf16)(w.view(np.uint16), xr, out)
    return out
