"""quant.iq4_quants through quant.quantize.quantize_rows: IQ4_NL and IQ4_XS rows, with and
without an imatrix, give the bytes of ggml's own ggml_quantize_chunk (quantize_iq4_nl /
quantize_iq4_xs, through ctypes in a subprocess of the llama-cpp-python interpreter) on random
rows, all-zero blocks, tiny and huge values, non-finite values and rows of exact ties between
two levels; and the quantized levels track the input (checked by decoding with gguf-py).
"""
from __future__ import annotations


import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import IQ4_NL as GGUF_IQ4_NL
from gguf.quants import dequantize

from quant.quantize import quantize_rows
from tests.test_quant_blocks import ggml_quantize_chunk

K = 512  # 2 IQ4_XS super-blocks, 16 IQ4_NL blocks
F32 = np.float32
IQ4 = (T.IQ4_NL, T.IQ4_XS)


def iq4_rows() -> dict[str, np.ndarray]:
    """Named float32[R, K] rows: the cases IQ4's scale search and level choice depend on."""
    rng = np.random.default_rng(17)
    levels = np.array(GGUF_IQ4_NL.kvalues, np.float64)
    ties = (levels[:-1] + levels[1:]) / 2  # midpoints: x / d exactly between two levels
    tie_rows = np.empty((3, K))
    for r in range(3):
        blocks = rng.choice(np.concatenate([ties, levels]), (K // 32, 32))
        blocks[:, 0] = -127.0  # the block max fixes d = 1 (then |x/d| on the midpoints)
        tie_rows[r] = (blocks * 2.0 ** (r - 1)).reshape(K)
    zero_blocks = rng.standard_normal((2, K))
    zero_blocks[0, :256] = 0  # a whole IQ4_XS super-block and 8 IQ4_NL blocks of zeros
    zero_blocks[1, 32:64] = 0  # one zero block inside an IQ4_XS super-block
    zero_blocks[1, 64:96] = 1e-16  # below GROUP_MAX_EPS
    spiky = rng.standard_normal((2, K)) * 0.01
    spiky[:, ::45] = 7.0
    cases = {
        "gaussian": rng.standard_normal((6, K)) * 0.02,
        "uniform": rng.uniform(-1, 1, (4, K)),
        "heavy_tailed": rng.standard_t(2, (4, K)),
        "one_signed": np.abs(rng.standard_normal((2, K))) * np.array([[1.0], [-1.0]]),
        "spiky": spiky,
        "zero": np.zeros((1, K)),
        "zero_blocks": zero_blocks,
        "ties": tie_rows,
        "constant": np.full((1, K), 0.3),
        "tiny": rng.standard_normal((2, K)) * np.array([[1e-12], [1e-30]]),
        "huge": rng.standard_normal((2, K)) * np.array([[6e4], [1e30]]),
    }
    nonfinite = rng.standard_normal((3, K))
    nonfinite[0, ::37] = np.nan
    nonfinite[0, 5::101] = np.inf
    nonfinite[1, 256:] = -np.inf
    nonfinite[2, :256] = 3e38
    out = {name: np.ascontiguousarray(v, dtype=F32) for name, v in cases.items()}
    with np.errstate(over="ignore"):
        out["nonfinite"] = nonfinite.astype(F32)
    return out


CASES = iq4_rows()
X = np.concatenate(list(CASES.values()))


def _weights() -> dict[str, np.ndarray | None]:
    rng = np.random.default_rng(5)
    with_zeros = (rng.random(K) * 3).astype(F32)
    with_zeros[rng.random(K) < 0.3] = 0
    with_zeros[:32] = 0
    return {"none": None, "ones": np.ones(K, F32), "lognormal": rng.lognormal(0, 2, K).astype(F32),
            "with_zeros": with_zeros, "tiny": np.full(K, 1e-30, F32)}


WEIGHTS = _weights()


@pytest.fixture(scope="module")
def ggml_bytes(tmp_path_factory, oracle_python):
    """{weights name: {type: ggml_quantize_chunk bytes of X}}."""
    folder = tmp_path_factory.mktemp("ggml_oracle_iq4")
    return {name: ggml_quantize_chunk(oracle_python, folder, name, X, IQ4, qw) for name, qw in WEIGHTS.items()}


def _case_of(row: int) -> str:
    at = 0
    for name, rows in CASES.items():
        at += rows.shape[0]
        if row < at:
            return name
    return "?"


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("t", IQ4, ids=lambda t: t.name)
def test_same_bytes_as_ggml(ggml_bytes, t, weights):
    got = quantize_rows(t, X, WEIGHTS[weights])
    want = ggml_bytes[weights][t]
    assert got.shape == want.shape
    bad = np.flatnonzero((got != want).any(axis=1))
    assert bad.size == 0, (f"{bad.size} of {X.shape[0]} rows differ from ggml, first row {bad[0]} "
                           f"({_case_of(bad[0])})")


def test_weights_change_bytes_and_levels_track_input():
    """The imatrix changes some bytes; decoded rows stay close to the input (relative RMS < 0.12)."""
    x = CASES["gaussian"]
    for t in IQ4:
        plain = quantize_rows(t, x)
        weighted = quantize_rows(t, x, WEIGHTS["lognormal"])
        assert (plain != weighted).any()
        back = dequantize(plain, t).reshape(x.shape)
        rel = np.sqrt(np.mean((back - x) ** 2) / np.mean(x ** 2))
        assert rel < 0.12, (t.name, rel)
        assert (dequantize(quantize_rows(t, CASES["zero"]), t) == 0).all()
