"""IQ1_S, IQ1_M, TQ1_0, TQ2_0 (kernels_cpu.iq1tq) against ggml bit for bit.

Fixtures: tests/data/iq1tq.npz from tools/make_iq1tq_fixtures.py (ggml's to_float, vec_dot
and ggml_mul_mat of the oracle build on this AVX2 machine). Dequantization is also held to
gguf.quants.dequantize; IQ1 delta sign bits are forced both ways.
"""
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from kernels_cpu.dequant import dequantize
from kernels_cpu.ggml_types import TYPES
from kernels_cpu.matmul import matmul, quantize_activations

DATA = Path(__file__).parent / "data" / "iq1tq.npz"
NAMES = ("IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0")
MM_T = (1, 2, 5, 8, 11)


@pytest.fixture(scope="module")
def fx():
    return dict(np.load(DATA))


def _bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("name", NAMES)
def test_dequant_equals_ggml_and_gguf(fx, name):
    t = T[name]
    w = fx[f"{name}_w"]
    ours = dequantize(w, t)
    assert ours.shape == (8, 512)
    np.testing.assert_array_equal(_bits(ours), _bits(fx[f"{name}_deq"]))
    np.testing.assert_array_equal(_bits(ours), _bits(gguf_dequantize(w, t)))
    assert np.all(ours[5, :256] == 0) and np.isfinite(ours).all()
    assert np.abs(ours[6, :256]).max() > 1000  # the f16-max block is there


@pytest.mark.parametrize("name", ("IQ1_S", "IQ1_M"))
@pytest.mark.parametrize("sign", (0, 1))
def test_iq1_delta_sign_bits(fx, name, sign):
    """Every delta sign bit set / cleared: values are grid -/+ 0.125, as gguf-py."""
    w = fx[f"{name}_w"].copy().reshape(8, 2, -1)
    if name == "IQ1_S":
        qh = w[:, :, 34:50]
        qh[:, :, 1::2] = (qh[:, :, 1::2] & 0x7F) | (0x80 * sign)
    else:
        w[:, :, 32:48] = (w[:, :, 32:48] & 0x77) | (0x88 * sign)
    w = np.ascontiguousarray(w.reshape(8, -1))
    ours = dequantize(w, T[name])
    np.testing.assert_array_equal(_bits(ours), _bits(gguf_dequantize(w, T[name])))
    frac = np.abs(ours[:5] / np.where(ours[:5] == 0, 1, ours[:5]))  # nonzero everywhere (delta != 0)
    assert (ours[:5] != 0).all() and frac.max() == 1


@pytest.mark.parametrize("name", NAMES)
def test_vec_dot_t1(fx, name):
    """T = 1 rows against ggml_vec_dot_<type>_q8_K (from type_traits_cpu) for all 11 x rows."""
    w, x = fx[f"{name}_w"], fx["x"]
    for t in range(x.shape[0]):
        out = matmul(w, T[name], np.ascontiguousarray(x[t:t + 1]))
        np.testing.assert_array_equal(_bits(out[0]), _bits(fx[f"{name}_vecdot"][t]), err_msg=f"x row {t}")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rows", (6, 8))
def test_mul_mat_batches(fx, name, rows):
    """ggml_mul_mat through a graph: T = 1, 2, 5, 8, 11, R % 8 == 0 and not; batch_invariant too."""
    w = np.ascontiguousarray(fx[f"{name}_w"][:rows])
    for T_ in MM_T:
        x = np.ascontiguousarray(fx["x"][:T_])
        want = _bits(fx[f"{name}_mm{T_}_{rows}"])
        np.testing.assert_array_equal(_bits(matmul(w, T[name], x)), want, err_msg=f"T={T_}")
        bi = _bits(matmul(w, T[name], x, batch_invariant=True))
        if T_ < 8 or name.startswith("TQ"):  # IQ1 batches of >= 8 take llama.cpp's tiled matmul
            np.testing.assert_array_equal(bi, want, err_msg=f"T={T_} bi")
        else:  # batch-invariant: each row as llama.cpp computes it alone (vec_dot)
            np.testing.assert_array_equal(bi, _bits(fx[f"{name}_vecdot"][:T_, :rows]), err_msg=f"T={T_} bi")
        xq = quantize_activations(T[name], x)
        np.testing.assert_array_equal(_bits(matmul(w, T[name], x, xq=xq)), want)


@pytest.mark.parametrize("name", NAMES)
def test_mul_mat_long_rows(fx, name):
    """ggml_mul_mat over K = 2560 (10 blocks), 16 rows, T = 1 (vec_dot) and T = 9 (IQ1: tiled)."""
    w = fx[f"{name}_big_w"]
    for T_ in (1, 9):
        x = np.ascontiguousarray(fx["x_big"][:T_])
        np.testing.assert_array_equal(_bits(matmul(w, T[name], x)), _bits(fx[f"{name}_big{T_}"]), err_msg=f"T={T_}")


def test_type_rows():
    """Block sizes as ggml (gguf's GGML_QUANT_SIZES) and Q8_K activations."""
    from gguf import GGML_QUANT_SIZES
    for name in NAMES:
        row = TYPES[T[name]]
        assert (row.block_size, row.type_size) == GGML_QUANT_SIZES[T[name]]
        assert row.vec_dot_type == T.Q8_K


# ---------------------------------------------------------------------------------------------
# the AVX2 tiles (kernels_cpu.iq1tq_avx2 through kernels_cpu.iq1tq_kernels) against the numba
# kernels of kernels_cpu.iq1tq, bit for bit

_F16_AT = {"IQ1_S": 0, "TQ1_0": 52, "TQ2_0": 64}  # byte offset of the f16 d (IQ1_M: top nibbles of its scales)


def _set_d(blocks, name, bits):
    """Give every block of uint8[..., type_size] the f16 scale ``bits``."""
    if name == "IQ1_M":
        sc = blocks[..., 48:56].view(np.uint16)
        for k in range(4):
            sc[..., k] = (sc[..., k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
    else:
        blocks[..., _F16_AT[name]:_F16_AT[name] + 2].view(np.uint16)[..., 0] = bits


def _weights(name, R, K, rng):
    """uint8[R, row_bytes]: random blocks with finite f16 scales, then edge-case rows: a zero row,
    the f16 max and a subnormal scale, every byte 0xFF (top scales, delta signs set), all 0x00."""
    size = TYPES[T[name]].type_size
    w = rng.integers(0, 256, (R, K // 256, size), dtype=np.uint8)
    _set_d(w, name, rng.integers(0x2000, 0x3C00, (R, K // 256), dtype=np.uint16))
    for r, (fill, bits) in enumerate(((0, 0), (None, 0x7BFF), (None, 0x0003), (0xFF, 0x3555), (0x00, 0x2E66))):
        if r < R:
            if fill is not None:
                w[r] = fill
            _set_d(w[r], name, bits)
    return np.ascontiguousarray(w.reshape(R, -1))


def _activations(T_, K, rng):
    x = rng.normal(0, 1, (T_, K)).astype(np.float32)
    x[0, :256] = 0  # a zero block: d = 0
    if T_ > 1:
        x[1] *= 1e4
    if T_ > 2:
        x[2, ::7] = -300  # many quants at -127
    return x


def _numba_ref(name, bi, w, xq):
    from kernels_cpu import iq1tq
    qs, d, bsums = xq.arrays
    out = np.full((qs.shape[0], w.shape[0]), np.nan, np.float32)
    suffix = "_bi" if bi and name.startswith("IQ1") else ""
    getattr(iq1tq, f"matmul_{name.lower()}_q8_k{suffix}")(w, qs, d, bsums, out)
    return out


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("K", (256, 2560))
def test_avx2_tiles_equal_numba_kernels(name, K):
    """Every R (tile edges: R < 4, R % 4 != 0, R % 8 != 0) and T (decode tiles, VEC_DOT, TILED at
    T >= 8, the _bi kernels), int8 and int16 activation quants: the vector tiles' outputs equal the
    numba kernels' bit for bit."""
    from kernels_cpu import iq1tq_kernels
    from kernels_cpu.matmul_kernels import quant_kernel
    if name.lower() not in iq1tq_kernels.AVX2_TYPES:
        pytest.skip("no AVX2: the numba kernels run")
    rng = np.random.default_rng(K + len(name))
    t = T[name]
    for R in (1, 3, 6, 13, 40):
        w = _weights(name, R, K, rng)
        for T_ in MM_T:
            xq = quantize_activations(t, _activations(T_, K, rng))
            qs, d, bsums = xq.arrays
            for bi in (False, True):
                want = _bits(_numba_ref(name, bi, w, xq))
                for q in (qs, qs.astype(np.int16)):
                    out = np.full((T_, R), np.nan, np.float32)
                    quant_kernel(t, R, bi)(w, q, d, bsums, out)
                    np.testing.assert_array_equal(_bits(out), want, err_msg=f"R={R} T={T_} bi={bi} {q.dtype}")
