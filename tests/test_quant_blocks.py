"""quant.quantize.quantize_rows: llama.cpp's bytes, and the accuracy each format guarantees.

1. Golden: every non-F32 tensor of the five llama-quantize mixes of gemma-3-270m, quantized from
   the F16 source, has the sha256 recorded in quantize.json.
2. Round trip through kernels_cpu.dequant on random and edge-case rows, within error bounds
   derived from each type's algorithm (see the bound functions below).
3. ggml itself (ggml_quantize_chunk through ctypes, in a subprocess of the llama-cpp-python
   interpreter) gives the same bytes on those rows and on non-finite ones, for all 12 types.
"""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from edge.gguf_file import GGUFFile
from kernels_cpu.dequant import dequantize
from quant.quantize import SUPPORTED_TYPES, QuantizeError, quantize_rows
from tests.conftest import golden

K = 512  # values per test row: 2 K-quant super-blocks, 16 blocks of 32
# the 12 types ggml_quantize_chunk converts to; IQ4_NL / IQ4_XS: tests/test_iq4_quants.py
QUANTIZED = [t for t in SUPPORTED_TYPES if t not in (T.F32, T.IQ4_NL, T.IQ4_XS)]
ORACLE_SCRIPT = Path(__file__).with_name("ggml_oracle_quantize.py")
F32 = np.float32


def ggml_quantize_chunk(oracle_python, folder: Path, tag: str, x: np.ndarray, types, qw: np.ndarray | None = None
                        ) -> dict[T, np.ndarray]:
    """{type: uint8[R, row bytes]}: ggml_quantize_chunk of x f32[R, K] to each type (imatrix qw f32[K] or
    None), run by ORACLE_SCRIPT in the oracle interpreter through files ``folder/in_<tag>.npz`` / ``out_<tag>.npz``."""
    K = x.shape[1]
    row_bytes = np.array([K // GGML_QUANT_SIZES[t][0] * GGML_QUANT_SIZES[t][1] for t in types], np.int64)
    extra = {} if qw is None else {"qw": qw}
    np.savez(folder / f"in_{tag}.npz", x=x, types=np.array([int(t) for t in types], np.int64),
             row_bytes=row_bytes, **extra)
    subprocess.run([str(oracle_python), str(ORACLE_SCRIPT), str(folder / f"in_{tag}.npz"),
                    str(folder / f"out_{tag}.npz")], check=True, timeout=300)
    out = np.load(folder / f"out_{tag}.npz")
    return {t: out[str(int(t))] for t in types}


def _per_block(first: np.ndarray, rest: np.ndarray) -> np.ndarray:
    """Rows whose every 32-value block starts with the values `first`, then values from `rest`."""
    rows = rest.reshape(-1, K // 32, 32).copy()
    rows[:, :, :first.size] = first
    return rows.reshape(-1, K)


def edge_case_rows() -> dict[str, np.ndarray]:
    """Named float32[R, K] inputs: random data and the cases where rounding rules, clamps and
    degenerate scales matter. Magnitudes stay below 6e4 so every fp16 scale and min is finite."""
    rng = np.random.default_rng(7)
    half = lambda n, size: rng.integers(-2 * n, 2 * n + 1, size) * 0.5  # noqa: E731 (multiples of 0.5 in [-n, n])
    ints = lambda n, size: rng.integers(-n, n + 1, size).astype(np.float64)  # noqa: E731
    outliers = rng.standard_normal((4, K)) * 0.02
    outliers[:, ::97] *= 300
    one = np.zeros((2, K))
    one[0, 77] = 0.375
    one[1, 300] = -1.5e-3
    cases = {
        "gaussian": rng.standard_normal((8, K)) * 0.02,
        "heavy_tailed": np.clip(rng.standard_t(2, (8, K)) * 0.01, -6e4, 6e4),
        "outliers": outliers,
        "zeros": np.zeros((1, K)),
        "one_nonzero": one,
        # ties: x * id lands on the rounding boundary of each 32-block rule (d = +-1 exactly)
        "ties_q8_0": _per_block(np.array([127.0]), half(127, (2, K))),
        "ties_q4_0": _per_block(np.array([8.0]), half(8, (2, K))),
        "ties_q5_0": _per_block(np.array([-16.0]), half(16, (2, K))),
        "ties_q4_1": _per_block(np.array([-7.5, 7.5]), ints(7, (2, K))),
        "ties_q5_1": _per_block(np.array([-15.5, 15.5]), ints(15, (2, K))),
        "huge": rng.uniform(-6e4, 6e4, (4, K)),
        "tiny": rng.standard_normal((4, K)) * 1e-6,  # fp16 scales become subnormal or 0
        "subnormal": rng.standard_normal((4, K)) * 1e-40,  # float32 subnormals
        "equal_values": np.stack([np.full(K, 0.37), np.full(K, -1.25),
                                  np.repeat(rng.standard_normal(K // 32), 32)]),
        "negative_only": -np.abs(rng.standard_normal((4, K))) - 0.5,
        "positive_only": np.abs(rng.standard_normal((4, K))) + 0.5,
    }
    return {name: np.ascontiguousarray(v, dtype=F32) for name, v in cases.items()}


def non_finite_rows() -> np.ndarray:
    """Rows with NaN, +-Inf, values near FLT_MAX and subnormals mixed into normal data."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, K)).astype(F32)
    x[0, ::37] = np.nan
    x[0, 5::101] = np.inf
    x[0, 7::103] = -np.inf
    x[1, :256] = np.nan
    x[1, 256:] = np.inf
    x[2, :256] = F32(1e38)
    x[2, 256:] = F32(-3e38)
    x[3, :32] = -np.inf
    x[3, 32:64] = F32(1e-40)
    return x


CASES = edge_case_rows()


# ---------------------------------------------------------------------------------------------
# error bounds derived from the formats (float64 arithmetic on the float32 inputs)


def _f16_field(q: np.ndarray, block_bytes: int, offset: int) -> np.ndarray:
    """The fp16 field at `offset` of every block: float64[R, n_blocks]."""
    b = q.reshape(q.shape[0], -1, block_bytes)[..., offset:offset + 2]
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float64)


def _f16_error(h: np.ndarray) -> np.ndarray:
    """Bound on |v - h| when h = fp16(v): half an fp16 ulp is 2**-11 relative, 2**-25 absolute
    for subnormals; taken twice for margin (h may be rounded up from v)."""
    return 2.0**-10 * np.abs(h) + 2.0**-24


def bound_32_block(t: T, x: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Max |x - dequant| for Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, per value (float64[R, K]).

    Q8_0: q = roundf(x / d), d = amax/127 -> d/2, plus 127 * |d - fp16(d)| for the stored scale.
    Q4_0 / Q5_0: d = max/-n (n = 8 / 16), levels -n..n-1 (the value -max sits one step past the
    top level: error up to d) -> |d| * max(1/2, x/d - (n-1)), plus n * |d - fp16(d)|.
    Q4_1 / Q5_1: d = (max-min)/(2^b - 1), q = round((x-min)/d) -> d/2, plus (2^b - 1) |d - fp16(d)|
    and |min - fp16(min)|.
    """
    block_bytes = GGML_QUANT_SIZES[t][1]
    xb = x.reshape(x.shape[0], -1, 32)
    hd = _f16_field(q, block_bytes, 0)[..., None]
    if t == T.Q8_0:
        d = (np.abs(xb).max(axis=-1) / F32(127)).astype(np.float64)[..., None]
        bound = np.broadcast_to(d / 2 + 127 * np.abs(d - hd), xb.shape)
    elif t in (T.Q4_0, T.Q5_0):
        n = 8 if t == T.Q4_0 else 16
        first_max = np.take_along_axis(xb, np.abs(xb).argmax(axis=-1)[..., None], axis=-1)
        d = (first_max / F32(-n)).astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            past_top = np.where(d != 0, xb / d - (n - 1), 0)
        bound = np.abs(d) * np.maximum(0.5, past_top) + n * np.abs(d - hd)
    else:
        levels = 15 if t == T.Q4_1 else 31
        vmin = xb.min(axis=-1, keepdims=True)
        d = ((xb.max(axis=-1, keepdims=True) - vmin) / F32(levels)).astype(np.float64)
        hm = _f16_field(q, block_bytes, 2)[..., None]
        bound = np.broadcast_to(d / 2 + levels * np.abs(d - hd) + np.abs(vmin - hm), xb.shape)
    return bound.reshape(x.shape)


# K-quants: group size, nmax, offsets of d (and dmin) in the block, bits of the sub-block scales
K_QUANTS = {
    T.Q2_K: dict(group=16, nmax=3, d=80, dmin=82, scale_levels=15),
    T.Q3_K: dict(group=16, nmax=4, d=108, dmin=None, scale_levels=32),
    T.Q4_K: dict(group=32, nmax=15, d=0, dmin=2, scale_levels=63),
    T.Q5_K: dict(group=32, nmax=31, d=0, dmin=2, scale_levels=63),
    T.Q6_K: dict(group=16, nmax=32, d=208, dmin=None, scale_levels=128),
}


def check_k_quant(t: T, x: np.ndarray, y: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(weighted error, bound) per group of 16 / 32 values, float64[R, n_groups].

    Each group's scale search (make_qkx2_quants / make_q3_quants / make_qx_quants) only accepts
    a candidate that lowers its weighted error below the first candidate's, whose error per
    value is at most s0/2 (min/max grid, s0 = (max - min(min, 0)) / nmax) or s0 (signed grid,
    s0 = max|x| / nmax, one clamped level). The sub-block scales are then stored with b bits
    against the super-block scale d (error d/2, or d where the top level clamps, plus fp16
    rounding of d) and the quants redone as the nearest level, which can only lower each error:
    |x - y| <= |e_search| + nmax * |scale error| + |min error| =: |e_search| + D. Hence, with
    the algorithm's weights w: Q2_K (absolute error) sum w|x-y| <= (s0/2 + D) sum w; the others
    (squared error) sqrt(sum w (x-y)^2) <= (s0/2 or s0, + D) sqrt(sum w).
    """
    p = K_QUANTS[t]
    n, nmax, levels = p["group"], p["nmax"], p["scale_levels"]
    xg = x.reshape(x.shape[0], -1, n)
    err = np.abs(xg.astype(np.float64) - y.reshape(xg.shape))
    groups_per_block = 256 // n
    block_bytes = GGML_QUANT_SIZES[t][1]
    hd = np.repeat(_f16_field(q, block_bytes, p["d"]), groups_per_block, axis=1)
    dd = _f16_error(hd)
    if p["dmin"] is None:  # signed levels -nmax..nmax-1 around 0, w = x^2 (float32, as ggml)
        w = (xg * xg).astype(np.float64)
        s0 = np.abs(xg).max(axis=-1) / nmax + 1e-15  # groups below 1e-15 are left at 0
        delta = nmax * (np.abs(hd) + dd + levels * dd)
        per_value = s0 + delta
    else:  # levels 0..nmax minus a min >= 0
        hm = np.repeat(_f16_field(q, block_bytes, p["dmin"]), groups_per_block, axis=1)
        dm = _f16_error(hm)
        if t == T.Q2_K:
            w = np.abs(xg).astype(np.float64)
        else:
            av_x = np.sqrt((xg * xg).sum(axis=-1, dtype=F32) / F32(32))
            w = (av_x[..., None] + np.abs(xg)).astype(np.float64)
        s0 = (xg.max(axis=-1) - np.minimum(xg.min(axis=-1), 0)).astype(np.float64) / nmax
        delta = nmax * ((hd + dd) / 2 + levels * dd) + (hm + dm) / 2 + levels * dm
        per_value = s0 / 2 + delta
    sum_w = w.sum(axis=-1)
    x64 = np.abs(xg.astype(np.float64))
    if t == T.Q2_K:  # slack: float rounding of the sums and of dequantization
        return (w * err).sum(axis=-1), per_value * sum_w * (1 + 1e-3) + 2.0**-20 * (w * x64).sum(axis=-1)
    return (np.sqrt((w * err * err).sum(axis=-1)),
            per_value * np.sqrt(sum_w) * (1 + 1e-3) + 2.0**-20 * np.sqrt((w * x64 * x64).sum(axis=-1)))


def assert_within_bound(t: T, x: np.ndarray) -> None:
    q = quantize_rows(t, x)
    assert q.dtype == np.uint8 and q.shape == (x.shape[0], K // GGML_QUANT_SIZES[t][0] * GGML_QUANT_SIZES[t][1])
    y = dequantize(q, t)
    assert np.isfinite(y).all()
    if t == T.F32:
        np.testing.assert_array_equal(y, x)
        return
    if t in K_QUANTS:
        err, bound = check_k_quant(t, x, y, q)
    else:
        err = np.abs(x.astype(np.float64) - y)
        if t == T.F16:  # half an ulp: 11 significant bits, subnormal spacing 2**-24
            bound = 2.0**-11 * np.abs(x.astype(np.float64)) + 2.0**-25
        elif t == T.BF16:  # 8 significant bits, subnormal spacing 2**-133
            bound = 2.0**-8 * np.abs(x.astype(np.float64)) + 2.0**-134
        else:  # slack: float rounding of x * id and of dequantization
            bound = bound_32_block(t, x, q) * (1 + 1e-4) + 2.0**-20 * np.abs(x)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (f"{(err > bound).sum()} of {err.size} over the bound; worst at {worst}: "
                                  f"error {err[worst]!r} > bound {bound[worst]!r}")


@pytest.mark.parametrize("case", list(CASES))
# IQ4_NL / IQ4_XS: non-uniform levels, no uniform-step bound; their bytes: tests/test_iq4_quants.py
@pytest.mark.parametrize("t", [t for t in SUPPORTED_TYPES if t not in (T.IQ4_NL, T.IQ4_XS)], ids=lambda t: t.name)
def test_round_trip_within_format_bound(t, case):
    assert_within_bound(t, CASES[case])


def test_bound_check_can_fail():
    """The bounds are tight enough to catch one value moved by a few quantization steps."""
    x = CASES["gaussian"]
    at = np.abs(x[3]).argmax()
    for t in (T.Q8_0, T.Q4_1, T.Q2_K, T.Q4_K, T.Q6_K):
        q = quantize_rows(t, x)
        y = dequantize(q, t)
        y_bad = y.copy()
        y_bad[3, at] += 2 * np.abs(x[3, at])  # Q2_K: 3 steps of its group, Q8_0: 254
        if t in K_QUANTS:
            err, bound = check_k_quant(t, x, y_bad, q)
        else:
            err, bound = np.abs(x - y_bad.astype(np.float64)), bound_32_block(t, x, q)
        assert (err > bound).any(), t.name


def test_q8_0_rounds_half_away_from_zero():
    """quantize_row_q8_0_ref uses roundf (not the CPU backend's round-half-even)."""
    x = CASES["ties_q8_0"]
    q = quantize_rows(T.Q8_0, x)
    np.testing.assert_array_equal(_f16_field(q, 34, 0), 1.0)  # d = 127 / 127
    qs = q.reshape(-1, 34)[:, 2:].view(np.int8).reshape(x.shape).astype(np.float64)
    want = np.sign(x) * np.floor(np.abs(x.astype(np.float64)) + 0.5)
    np.testing.assert_array_equal(qs, want)
    assert (np.abs(x - np.trunc(x)) == 0.5).sum() > 100  # the rows really hold ties


@pytest.mark.parametrize("t", QUANTIZED, ids=lambda t: t.name)
def test_rows_independent_of_batching(t):
    """Rows run in parallel; each row's bytes equal the bytes of quantizing it alone."""
    x = np.concatenate([CASES["gaussian"], CASES["outliers"], CASES["heavy_tailed"]])
    whole = quantize_rows(t, x)
    for r in (0, 7, x.shape[0] - 1):
        np.testing.assert_array_equal(whole[r], quantize_rows(t, x[r:r + 1])[0])


@pytest.mark.parametrize("t", QUANTIZED, ids=lambda t: t.name)
def test_non_finite_values_stay_in_their_block(t):
    """NaN / Inf quantize without error, and the blocks without them are unchanged."""
    x = CASES["gaussian"][:2].copy()
    x[:, 300] = np.nan
    x[:, 400] = np.inf
    first_256 = 256 // GGML_QUANT_SIZES[t][0] * GGML_QUANT_SIZES[t][1]
    q = quantize_rows(t, x)
    np.testing.assert_array_equal(q[:, :first_256], quantize_rows(t, CASES["gaussian"][:2])[:, :first_256])
    assert q.shape == quantize_rows(t, non_finite_rows()[:2]).shape


def test_bad_input_raises():
    x = np.zeros((2, 100), F32)
    with pytest.raises(QuantizeError, match=r"Q8_0.*K=100.*block size 32"):
        quantize_rows(T.Q8_0, x)
    with pytest.raises(QuantizeError, match=r"Q4_K.*K=96.*block size 256"):
        quantize_rows(T.Q4_K, np.zeros((2, 96), F32))
    with pytest.raises(QuantizeError, match="float32"):
        quantize_rows(T.Q8_0, np.zeros((2, 64), np.float64))
    with pytest.raises(QuantizeError, match="2-D"):
        quantize_rows(T.Q8_0, np.zeros(64, F32))
    with pytest.raises(QuantizeError, match="C-contiguous"):
        quantize_rows(T.Q8_0, np.zeros((2, 128), F32)[:, ::2])
    with pytest.raises(QuantizeError, match="IQ2_XXS"):
        quantize_rows(T.IQ2_XXS, np.zeros((2, 256), F32))
    with pytest.raises(QuantizeError, match="unknown GGML type"):
        quantize_rows(12345, np.zeros((2, 64), F32))
    assert quantize_rows(T.Q4_K, np.zeros((0, 512), F32)).shape == (0, 288)
    assert quantize_rows(T.F16, np.zeros((3, 0), F32)).shape == (3, 0)


# ---------------------------------------------------------------------------------------------
# ggml's own quantizer


@pytest.fixture(scope="module")
def ggml_bytes(tmp_path_factory, oracle_python) -> tuple[np.ndarray, dict[T, np.ndarray]]:
    """(x, {type: ggml_quantize_chunk bytes}) for all edge-case and non-finite rows."""
    x = np.concatenate([*CASES.values(), non_finite_rows()])
    return x, ggml_quantize_chunk(oracle_python, tmp_path_factory.mktemp("ggml_oracle"), "all", x, QUANTIZED)


@pytest.mark.parametrize("t", QUANTIZED, ids=lambda t: t.name)
def test_same_bytes_as_ggml(ggml_bytes, t):
    x, want = ggml_bytes
    got = quantize_rows(t, x)
    bad_rows = np.flatnonzero((got != want[t]).any(axis=1))
    assert bad_rows.size == 0, f"{bad_rows.size} of {x.shape[0]} rows differ from ggml, first row {bad_rows[0]}"


# ---------------------------------------------------------------------------------------------
# golden: llama-quantize's tensors of gemma-3-270m

GOLDEN_MIXES = ("Q8_0", "Q4_0", "Q4_K_M", "Q6_K", "Q5_K_M")
_sha256_cache: dict[tuple[str, T], str] = {}  # (tensor, type) -> sha256, shared by the mixes


@pytest.fixture(scope="module")
def gemma_f16(gemma_f16_path):
    gf = GGUFFile(gemma_f16_path)
    yield gf
    gf.close()


def quantized_sha256(gf: GGUFFile, name: str, t: T) -> str:
    """sha256 of quantize_rows(t, tensor `name` of the F16 source as float32), in row chunks."""
    if (name, t) not in _sha256_cache:
        rows = gf.tensor_rows(name)
        h = hashlib.sha256()
        for start in range(0, rows.shape[0], 16384):
            x = rows[start:start + 16384].view(np.float16).astype(F32)
            h.update(quantize_rows(t, x).data)
        _sha256_cache[name, t] = h.hexdigest()
    return _sha256_cache[name, t]


@pytest.mark.slow
@pytest.mark.parametrize("mix", GOLDEN_MIXES)
def test_golden_tensor_bytes(gemma_f16, mix):
    tensors = [g for g in golden("gemma3-270m", "quantize.json")["quantized"][mix]["tensors"] if g["type"] != "F32"]
    assert len(tensors) == 127
    assert all(gemma_f16.tensors[g["name"]].ggml_type == T.F16 for g in tensors)
    wrong = [f"{g['name']} {g['type']}" for g in tensors
             if quantized_sha256(gemma_f16, g["name"], T[g["type"]]) != g["sha256"]]
    assert not wrong, f"{len(wrong)} of {len(tensors)} tensors differ from llama-quantize: {wrong[:5]}"
