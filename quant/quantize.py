"""ggml's quantizers, keyed by GGML type: float32 rows -> the exact bytes llama-quantize writes.

``quantize_rows(ggml_type, x, quant_weights=None)`` mirrors ggml.c ``ggml_quantize_chunk``.
Without an imatrix (``imatrix=NULL``): ggml-quants.c ``quantize_row_<type>_ref`` for Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1 (quant.legacy_quants), Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (quant.k_quants),
``quantize_iq4_nl`` / ``quantize_iq4_xs`` with and without weights (quant.iq4_quants),
``ggml_fp32_to_fp16_row`` (F16), ``ggml_fp32_to_bf16_row_ref`` (BF16) and a copy (F32); with one
(quant_weights), the weighted ``quantize_row_<type>_impl`` (quant.imatrix_quants). As built in
ggml-org/llama.cpp@0c1e57098 (llama-cpp-python 0.3.36, the build that made the goldens); the
float arithmetic is C's, operation by operation (quant.c_float).

Non-finite input goes through the same arithmetic: no error, no crash, and the bytes are those
ggml's code produces. Each type has its own kernel (compiled on first use, cached on disk) that
quantizes rows in parallel; blocks never span rows and every algorithm is block-local, so the
split changes no byte. Block layouts are the type table's (kernels_cpu.ggml_types): adding a
type edge writes is one QUANTIZERS entry beside its table row.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from kernels_cpu.ggml_types import sizes
from quant import imatrix_quants as w
from quant import iq4_quants as iq4
from quant import k_quants as k
from quant import legacy_quants as q
from quant.errors import QuantizeError

T = GGMLQuantizationType

# GGML type -> (kernel without an imatrix, kernel with one; None where ggml ignores the weights)
QUANTIZERS = {
    T.F16: (q.quantize_f16, None), T.BF16: (q.quantize_bf16, None), T.Q8_0: (q.quantize_q8_0, None),
    T.Q4_0: (q.quantize_q4_0, w.quantize_q4_0_imatrix), T.Q4_1: (q.quantize_q4_1, w.quantize_q4_1_imatrix),
    T.Q5_0: (q.quantize_q5_0, w.quantize_q5_0_imatrix), T.Q5_1: (q.quantize_q5_1, w.quantize_q5_1_imatrix),
    T.Q2_K: (k.quantize_q2_k, w.quantize_q2_k_imatrix), T.Q3_K: (k.quantize_q3_k, w.quantize_q3_k_imatrix),
    T.Q4_K: (k.quantize_q4_k, w.quantize_q4_k_imatrix), T.Q5_K: (k.quantize_q5_k, w.quantize_q5_k_imatrix),
    T.Q6_K: (k.quantize_q6_k, w.quantize_q6_k_imatrix),
    T.IQ4_NL: (iq4.quantize_iq4_nl, iq4.quantize_iq4_nl_imatrix),
    T.IQ4_XS: (iq4.quantize_iq4_xs, iq4.quantize_iq4_xs_imatrix),
}
SUPPORTED_TYPES = (T.F32, *QUANTIZERS)  # F32: a copy
# the types whose quantization uses imatrix weights -> kernel(x f32[R, K], out u8[R, row bytes], qw f32[K])
WEIGHTED_KERNELS = {t: weighted for t, (_, weighted) in QUANTIZERS.items() if weighted is not None}

__all__ = ["QUANTIZERS", "SUPPORTED_TYPES", "WEIGHTED_KERNELS", "QuantizeError", "quantize_rows"]


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
    (quant.imatrix_quants) for Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, while
    F32, F16, BF16 and Q8_0 ignore them as ggml does.
    ggml_type: a gguf.GGMLQuantizationType (or its int id) in SUPPORTED_TYPES: F32, F16, BF16,
    Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS (quant.iq4_quants,
    the imatrix-capable quantize_iq4_nl / quantize_iq4_xs, weighted when quant_weights are given).
    Shapes: x float32[R, K], C-contiguous, K a multiple of the type's block size (32 for
    Q4_0..Q8_0 and IQ4_NL, 256 for the K-quants and IQ4_XS, 1 for F32/F16/BF16) -> uint8[R, K / block * type_size],
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
    block_size, type_size = sizes(t)
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
    plain, weighted = QUANTIZERS[t]
    if quant_weights is not None and weighted is not None:
        weighted(x, out, np.ascontiguousarray(quant_weights))
    else:
        plain(x, out)
    return out
