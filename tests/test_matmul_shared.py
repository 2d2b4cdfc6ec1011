"""Activations quantized once and shared by several matmuls (Q/K/V, gate/up): the same bits
as quantizing for each; a format that does not match is quantized anew, and a shared xq in
the workspace is never overwritten by such a call."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from kernels_cpu.dequant import QuantFormatError
from kernels_cpu.matmul import MatmulWorkspace, matmul, quantize_activations
from tests.test_matmul import random_weights


@pytest.mark.parametrize("n_tokens", [1, 9])
def test_shared_activations_same_bits(n_tokens):
    rng = np.random.default_rng(3)
    K = 512
    x = rng.standard_normal((n_tokens, K)).astype(np.float32)
    ws = MatmulWorkspace(16, K)
    xq = quantize_activations(T.Q4_K, x, ws)
    for t in (T.Q4_K, T.Q6_K, T.Q5_K, T.Q8_0, T.Q5_1, T.F16):   # same format, other formats
        w = random_weights(t, 24, K, rng)
        want = matmul(w, t, x)
        assert np.array_equal(matmul(w, t, x, xq=xq, workspace=ws), want), t.name
    q0 = [a.copy() for a in xq.arrays]
    matmul(random_weights(T.Q8_0, 8, K, rng), T.Q8_0, 2 * x, xq=xq, workspace=ws)  # other format
    assert all(np.array_equal(a, b) for a, b in zip(q0, xq.arrays))


def test_quantize_activations_errors():
    assert quantize_activations(T.F32, np.zeros((1, 32), np.float32)) is None
    with pytest.raises(QuantFormatError, match="not whole Q4_K blocks"):
        quantize_activations(T.Q4_K, np.zeros((1, 32), np.float32))
    with pytest.raises(QuantFormatError, match="C-contiguous float32"):
        quantize_activations(T.Q8_0, np.zeros((1, 32), np.float64))
