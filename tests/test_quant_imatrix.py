"""quant.quantize.quantize_rows with quant_weights (the imatrix path, quant/imatrix_quants.py):
the same bytes as ggml's ggml_quantize_chunk(type, x, ..., imatrix) through ctypes, in a
subprocess of the llama-cpp-python interpreter, on random and edge-case rows and weights; the
weights change the bytes and the weighted error falls.
"""
from __future__ import annotations


import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from kernels_cpu.dequant import dequantize
from quant.quantize import WEIGHTED_KERNELS, QuantizeError, quantize_rows
from tests.test_quant_blocks import ggml_quantize_chunk

K = 512
F32 = np.float32
WEIGHTED = [t for t in WEIGHTED_KERNELS if t not in (T.IQ4_NL, T.IQ4_XS)]  # IQ4: tests/test_iq4_quants.py


def _rows(seed: int) -> np.ndarray:
    """Rows of varied shape: gaussian at several scales, heavy tails, one-signed, sparse,
    constant, zero, tiny, and rows with a large outlier per block."""
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal(K) * s for s in (1e-3, 0.02, 1.0, 300.0)]
    rows += [rng.standard_t(2, K), np.abs(rng.standard_normal(K)), -np.abs(rng.standard_normal(K)) - 0.5]
    sparse = rng.standard_normal(K)
    sparse[rng.random(K) < 0.8] = 0
    rows += [sparse, np.full(K, 0.75), np.zeros(K), rng.standard_normal(K) * 1e-20]
    spiky = rng.standard_normal(K) * 0.01
    spiky[::32] = 5.0
    rows.append(spiky)
    half_zero = rng.standard_normal(K)
    half_zero[:256] = 0
    rows.append(half_zero)
    return np.ascontiguousarray(np.stack(rows), dtype=F32)


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    lognormal = rng.lognormal(0.0, 2.0, K)
    with_zeros = rng.random(K).astype(F32) * 3
    with_zeros[rng.random(K) < 0.3] = 0
    with_zeros[:32] = 0  # a whole block (and a Q2_K group) without weight
    return {"ones": np.ones(K, F32), "lognormal": lognormal.astype(F32), "with_zeros": with_zeros,
            "tiny": np.full(K, 1e-30, F32)}


WEIGHTS = _weights()


@pytest.fixture(scope="module")
def ggml_bytes(tmp_path_factory, oracle_python):
    """{weights name: (x, {type: ggml_quantize_chunk bytes with that imatrix})}."""
    folder = tmp_path_factory.mktemp("ggml_oracle_imatrix")
    result = {}
    for i, (name, qw) in enumerate(WEIGHTS.items()):
        x = _rows(i)
        result[name] = x, ggml_quantize_chunk(oracle_python, folder, name, x, WEIGHTED, qw)
    return result


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("t", WEIGHTED, ids=lambda t: t.name)
def test_same_bytes_as_ggml_with_imatrix(ggml_bytes, t, weights):
    x, want = ggml_bytes[weights]
    got = quantize_rows(t, x, WEIGHTS[weights])
    bad_rows = np.flatnonzero((got != want[t]).any(axis=1))
    assert bad_rows.size == 0, f"{bad_rows.size} of {x.shape[0]} rows differ from ggml, first row {bad_rows[0]}"


@pytest.mark.parametrize("t", WEIGHTED, ids=lambda t: t.name)
def test_weights_lower_the_weighted_error(t):
    """Columns with 100x weight come out closer with the imatrix than without it."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, K)).astype(F32)
    qw = np.where(rng.random(K) < 0.1, 100.0, 1.0).astype(F32)
    errors = []
    for weights in (None, qw):
        back = dequantize(quantize_rows(t, x, weights), t, x.size).reshape(x.shape)
        errors.append(float((((back - x) ** 2) * qw).sum()))
    assert errors[1] < 0.9 * errors[0], errors


def test_types_without_weights_ignore_them():
    x = _rows(0)
    for t in (T.F32, T.F16, T.BF16, T.Q8_0):
        assert np.array_equal(quantize_rows(t, x, WEIGHTS["lognormal"]), quantize_rows(t, x))


def test_bad_weights_raise():
    x = _rows(0)
    with pytest.raises(QuantizeError, match=r"quant_weights must be float32\[512\]"):
        quantize_rows(T.Q4_K, x, np.ones(256, F32))
    with pytest.raises(QuantizeError, match="quant_weights must be float32"):
        quantize_rows(T.Q4_K, x, np.ones(K, np.float64))
