"""Activation quantization (Q8_0, Q8_1, Q8_K): exact agreement with the numpy references."""
from __future__ import annotations

import numpy as np
import pytest

from kernels_cpu.dequant import QuantFormatError
from kernels_cpu.quantize_act import quantize_q8_0, quantize_q8_1, quantize_q8_k
from quant.activations import quantize_q8_0_ref, quantize_q8_1_ref, quantize_q8_k_ref


def activations(T: int, K: int, seed: int) -> np.ndarray:
    """Rows mixing the cases that matter: normal values, outliers, zero blocks, exact ties,
    tiny values (f16 scale underflows), huge values (f16 scale overflows), negative maxima."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (T, K)).astype(np.float32)
    x[:, ::97] *= 50  # outliers
    rows = np.arange(T)
    x[rows % 5 == 1, :256] = 0  # all-zero blocks (Q8_0 and Q8_K)
    ties = rng.integers(-127, 127, K).astype(np.float32) + np.float32(0.5)  # k + 0.5, scale 1
    ties[::32] = 127  # amax 127 -> 127 / amax = 1 exactly, so x * inv is a tie
    ties[::256] = -127  # Q8_K: max is negative, iscale = 1
    x[rows % 5 == 2] = ties
    x[rows % 5 == 3] *= np.float32(1e-6)  # d below the f16 subnormal range
    x[rows % 5 == 4, : K // 2] *= np.float32(1e7)  # d above f16 max -> inf
    return x


SHAPES = [(1, 256), (2, 512), (7, 896 // 128 * 256), (5, 4864 // 256 * 256)]


def assert_equal_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if got.dtype == np.float32:
        got, want = got.view(np.uint32), want.view(np.uint32)
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{what}: {len(bad)} differ, first at {tuple(bad[0])}"


@pytest.mark.parametrize("T,K", SHAPES)
def test_q8_0(T, K):
    x = activations(T, K, seed=T * K)
    qs, d = quantize_q8_0(x)
    qs_ref, d_ref = quantize_q8_0_ref(x)
    assert_equal_bits(qs, qs_ref, "qs")
    assert_equal_bits(d, d_ref, "d")


@pytest.mark.parametrize("T,K", SHAPES)
def test_q8_1(T, K):
    x = activations(T, K, seed=T * K + 1)
    for got, want, name in zip(quantize_q8_1(x), quantize_q8_1_ref(x), ("qs", "d", "s")):
        assert_equal_bits(got, want, name)


@pytest.mark.parametrize("T,K", SHAPES)
def test_q8_k(T, K):
    x = activations(T, K, seed=T * K + 2)
    for got, want, name in zip(quantize_q8_k(x), quantize_q8_k_ref(x), ("qs", "d", "bsums")):
        assert_equal_bits(got, want, name)


def test_ties_round_to_even():
    """x * 127/amax = k + 0.5 exactly: ggml's x86 path rounds to even (not away from zero)."""
    x = np.zeros((1, 256), np.float32)
    x[0, :4] = [127, 2.5, -3.5, 0.5]
    qs, d = quantize_q8_0(x)
    np.testing.assert_array_equal(qs[0, :4], [127, 2, -4, 0])
    assert d[0, 0] == np.float32(1.0)
    qk, dk, bsums = quantize_q8_k(-x)  # max = -127 -> iscale = 1, d = 1
    np.testing.assert_array_equal(qk[0, :4], [-127, -2, 4, 0])
    assert dk[0, 0] == np.float32(1.0) and bsums[0, 0] == -125


def test_known_block_values():
    x = np.zeros((1, 256), np.float32)
    x[0, 3] = -2.0  # Q8_K: max = -2 -> iscale = 63.5, so x[3] -> -127 and d = 1/63.5
    x[0, 40] = 1.0  # 63.5 -> 64 (ties to even)
    qs, d, bsums = quantize_q8_k(x)
    assert qs[0, 3] == -127 and qs[0, 40] == 64 and np.count_nonzero(qs) == 2
    assert d[0, 0] == np.float32(1) / np.float32(63.5)
    assert bsums[0, 0] == -127 and bsums[0, 2] == 64 and bsums[0].sum() == -63
    q0, d0, s0 = quantize_q8_1(x)  # 32-value blocks: block 0 holds x[3], block 1 holds x[40]
    assert q0[0, 3] == -127 and q0[0, 40] == 127
    assert d0[0, 0] == np.float32(np.float16(np.float32(2) / np.float32(127)))
    assert s0[0, 0] == np.float32(np.float16(np.float32(2) / np.float32(127) * np.float32(-127)))
    assert s0[0, 1] == np.float32(np.float16(np.float32(1) / np.float32(127) * np.float32(127)))
    assert not d0[0, 2:].any() and not s0[0, 2:].any()


def test_buffers_are_reused():
    x = activations(3, 512, seed=5)
    qs = np.empty((3, 512), np.int8)
    d = np.empty((3, 16), np.float32)
    s = np.empty((3, 16), np.float32)
    out = quantize_q8_1(x, qs, d, s)
    assert out[0] is qs and out[1] is d and out[2] is s
    assert_equal_bits(s, quantize_q8_1_ref(x)[2], "s")


def test_int16_quants_buffer():
    """qs may be int16 (the widened form matmul reads): same values as int8."""
    x = activations(2, 512, seed=11)
    qs16 = np.empty((2, 512), np.int16)
    assert quantize_q8_k(x, qs=qs16)[0] is qs16
    np.testing.assert_array_equal(qs16, quantize_q8_k_ref(x)[0])
    assert quantize_q8_0(x, qs=qs16)[0] is qs16
    np.testing.assert_array_equal(qs16, quantize_q8_0_ref(x)[0])


def test_errors():
    with pytest.raises(QuantFormatError, match="multiple of the block size 256"):
        quantize_q8_k(np.zeros((1, 896), np.float32))
    with pytest.raises(QuantFormatError, match="float32"):
        quantize_q8_0(np.zeros((1, 32), np.float64))
    with pytest.raises(QuantFormatError, match=r"d must be a writeable C-contiguous float32\[1, 1\]"):
        quantize_q8_0(np.zeros((1, 32), np.float32), d=np.zeros((1, 2), np.float32))
    with pytest.raises(QuantFormatError, match=r"qs must be a writeable C-contiguous int8/int16\[1, 32\]"):
        quantize_q8_0(np.zeros((1, 32), np.float32), qs=np.zeros((1, 32), np.int32))

