"""Quantized matmul: bit for bit against llama.cpp's own results (tests/data/llama_matmul.npz)
and against the numpy model of its arithmetic (tests/matmul_reference.py) over a grid of shapes,
within float64 error bounds, and on real model tensors."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from edge.gguf_file import GGUFFile
from kernels_cpu.dequant import QuantFormatError, dequantize
from kernels_cpu.matmul import MatmulWorkspace, matmul
from kernels_cpu.matmul_kernels import quant_kernel
from kernels_cpu.matmul_tiling import NR, NT, TC
from kernels_cpu.quantize_act import quantize_q8_0, quantize_q8_1, quantize_q8_k
from tests.matmul_reference import reference_matmul

FIXTURES = Path(__file__).resolve().parent / "data" / "llama_matmul.npz"

Q8_0_TYPES = (T.Q4_0, T.Q5_0, T.Q8_0)
Q8_1_TYPES = (T.Q4_1, T.Q5_1)
Q8_K_TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
ALL_TYPES = Q8_0_TYPES + Q8_1_TYPES + Q8_K_TYPES + FLOAT_TYPES
# byte offsets of the f16 fields of one block: (d-like scales, the Q4_1/Q5_1 min m)
F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
              T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_weights(t: T, R: int, K: int, rng) -> np.ndarray:
    """uint8[R, row_bytes]: random quants, finite f16 scales of a realistic size."""
    if t == T.F32:
        return rng.normal(0, 1, (R, K)).astype(np.float32).view(np.uint8)
    if t == T.F16:
        return rng.normal(0, 1, (R, K)).astype(np.float16).view(np.uint8)
    if t == T.BF16:
        return (rng.normal(0, 1, (R, K)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, size = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (R, K // block, size), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        raw[..., off:off + 2] = rng.normal(0, 0.02, raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(R, -1)


def bf16_round(x: np.ndarray) -> np.ndarray:
    u = x.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(np.float32)


def ggml_reference(w: np.ndarray, t: T, x: np.ndarray) -> np.ndarray:
    """float64 value of what ggml computes: x converted to the vec_dot type, exact block sums.

    Q8_1 pairs use the stored f16 s = d*sum(q) for the min term (m * s), as ggml does.
    """
    W = dequantize(w, t).astype(np.float64)
    Tn, K = x.shape
    if t == T.F32:
        return x.astype(np.float64) @ W.T
    if t == T.F16:
        return x.astype(np.float16).astype(np.float64) @ W.T
    if t == T.BF16:
        return bf16_round(x).astype(np.float64) @ W.T
    if t in Q8_K_TYPES:
        qs, d, _ = quantize_q8_k(x)
        block = 256
    else:
        qs, d = quantize_q8_0(x)[:2]
        block = 32
    xq = (qs.reshape(Tn, -1, block) * d[..., None].astype(np.float64)).reshape(Tn, K)
    ref = xq @ W.T
    if t in Q8_1_TYPES:  # replace m * d * sum(q) by m * s
        _, d1, s = quantize_q8_1(x)
        m = w.reshape(w.shape[0], -1, GGML_QUANT_SIZES[t][1])[..., 2:4].copy().view(np.float16)[..., 0]
        sums = qs.reshape(Tn, -1, 32).astype(np.float64).sum(-1)
        ref += (s.astype(np.float64) - d1 * sums) @ m.astype(np.float64).T
    return ref


def activation_bound(w: np.ndarray, t: T, x: np.ndarray) -> np.ndarray:
    """Bound on |W x - matmul|: each x within amax/127 of its quantized value (half a step plus
    the f16 rounding of the scale), for float types the f16/bf16 rounding of x."""
    W = np.abs(dequantize(w, t).astype(np.float64))
    ax = np.abs(x.astype(np.float64))
    if t in FLOAT_TYPES:
        rel = {T.F32: 1e-7, T.F16: 2.0**-11, T.BF16: 2.0**-8}[t]
        return (ax * rel) @ W.T
    block = 256 if t in Q8_K_TYPES else 32
    amax = ax.reshape(x.shape[0], -1, block).max(-1)
    step = np.repeat(amax / 127, block, axis=1)
    return step @ W.T


SHAPES = [  # R, K (in blocks of 256), T: R not a multiple of NR, one and several blocks, T over NT/TC;
    # R % 8 == 0: llama.cpp's repacked Q4_0/Q4_K/Q2_K (gemm for T - T % 4 rows, gemv for the rest)
    (1, 1, 1), (37, 1, 1), (37, 3, 2), (13, 2, 7), (6, 1, 64), (9, 1, TC + 6), (3, 1, 2 * TC + 1),
    (16, 2, 1), (16, 2, 3), (8, 1, 13), (24, 2, TC + 7),
]


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_grid(t):
    rng = np.random.default_rng(int(t))
    for R, n256, Tn in SHAPES:
        K = 256 * n256
        w = random_weights(t, R, K, rng)
        x = rng.normal(0, 1, (Tn, K)).astype(np.float32)
        x[:, ::61] *= 20  # outliers make the per-block scales differ
        out = matmul(w, t, x)
        assert out.shape == (Tn, R) and out.dtype == np.float32
        ref = ggml_reference(w, t, x)
        scale = np.abs(x.astype(np.float64)) @ np.abs(dequantize(w, t).astype(np.float64)).T
        err = np.abs(out - ref)
        assert (err <= 1e-5 * scale + 1e-30).all(), f"{t.name} R={R} K={K} T={Tn}: max rel {(err / scale).max():.2e}"
        exact = x.astype(np.float64) @ dequantize(w, t).astype(np.float64).T
        bound = activation_bound(w, t, x)
        assert (np.abs(out - exact) <= bound + 1e-5 * scale).all(), f"{t.name} R={R} K={K} T={Tn}"
        if t not in FLOAT_TYPES:
            assert_same_bits(out, reference_matmul(w, t, x), f"{t.name} R={R} K={K} T={Tn}")


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32, what
    bad = np.argwhere(got.view(np.uint32) != want.view(np.uint32))
    if bad.size:
        at = tuple(bad[0])
        raise AssertionError(f"{what}: {len(bad)} of {got.size} differ, first at {at}: {got[at]!r} != {want[at]!r}")


def _fixture_cases() -> list[str]:
    return [str(c) for c in np.load(FIXTURES)["cases"]] if FIXTURES.exists() else []


@pytest.fixture(scope="module")
def llama_matmul():
    if not FIXTURES.exists():
        pytest.skip(f"{FIXTURES} is missing (tools/make_matmul_fixtures.py makes it)")
    return np.load(FIXTURES)


@pytest.mark.parametrize("case", _fixture_cases())
def test_llama_cpp_results_bit_for_bit(llama_matmul, case):
    """llama.cpp's results for every quantized type and kernel it picks (tinyBLAS / vec_dot,
    tiled, repacked gemm + gemv; T = 1 .. 11), on synthetic weights and on gemma-3-270m's
    layer 0 with its real activations: edge and the numpy model give the same bits."""
    z = llama_matmul
    w, t = z[str(z[f"{case}_w"])], int(z[f"{case}_type"])
    x = np.ascontiguousarray(z[str(z[f"{case}_x"])][: int(z[f"{case}_T"])])
    want = z[f"{case}_out"]
    assert_same_bits(matmul(w, t, x), want, f"{case}: edge")
    assert_same_bits(reference_matmul(w, t, x), want, f"{case}: numpy model")


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_one_block_of_32(t):
    """K = one 32-value block (Q8_0/Q8_1 types) or one 256-value block."""
    rng = np.random.default_rng(3)
    K = GGML_QUANT_SIZES[t][0]
    w = random_weights(t, NR * 3 + 1, K, rng)
    x = rng.normal(0, 1, (NT + 1, K)).astype(np.float32)
    ref = ggml_reference(w, t, x)
    np.testing.assert_allclose(matmul(w, t, x), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("t", [T.Q5_0, T.Q5_1, T.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n_tokens", [1, 5])
def test_kernels_take_int8_or_int16_quants(t, n_tokens):
    """The per-type kernels give identical results from int8 quants and from their int16 widening."""
    rng = np.random.default_rng(4)
    w = random_weights(t, 11, 512, rng)
    x = rng.normal(0, 1, (n_tokens, 512)).astype(np.float32)
    quantize = {T.Q5_0: quantize_q8_0, T.Q5_1: quantize_q8_1, T.Q4_K: quantize_q8_k}[t]
    qs, *scales = quantize(x)
    outs = []
    for quants in (qs, qs.astype(np.int16)):
        out = np.empty((n_tokens, 11), np.float32)
        quant_kernel(t, w.shape[0])(w, quants, *scales, out)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], matmul(w, t, x))


def test_known_q8_0_product():
    """One Q8_0 row of 2s (d = 1) times x = 1..32 scaled: exact small integers."""
    w = np.zeros((1, 34), np.uint8)
    w[0, :2] = np.array([1.0], np.float16).view(np.uint8)
    w[0, 2:] = 2
    x = np.full((1, 32), 127.0, np.float32)  # quantizes to q = 127, d = 1
    assert matmul(w, T.Q8_0, x)[0, 0] == 2 * 127 * 32


def test_zero_inputs_give_zero():
    for t in ALL_TYPES:
        K = 256
        w = np.zeros((5, K // GGML_QUANT_SIZES[t][0] * GGML_QUANT_SIZES[t][1]), np.uint8)
        out = matmul(w, t, np.zeros((3, K), np.float32))
        assert not out.any() and not np.isnan(out).any(), t.name


def test_workspace_and_out_are_reused():
    rng = np.random.default_rng(9)
    ws = MatmulWorkspace(max_tokens=8, max_k=512)
    for t in (T.Q4_K, T.Q5_1, T.Q8_0, T.F16):
        w = random_weights(t, 10, 512, rng)
        x = rng.normal(0, 1, (3, 512)).astype(np.float32)
        out = np.empty((3, 10), np.float32)
        assert matmul(w, t, x, out, ws) is out
        np.testing.assert_array_equal(out, matmul(w, t, x))
    with pytest.raises(ValueError, match="workspace holds 8 x 512"):
        matmul(random_weights(T.Q8_0, 2, 512, rng), T.Q8_0, np.zeros((9, 512), np.float32), workspace=ws)


def test_errors():
    w = np.zeros((4, 144), np.uint8)
    with pytest.raises(QuantFormatError, match=r"expected \[T >= 1, 256\]"):
        matmul(w, T.Q4_K, np.zeros((1, 512), np.float32))
    with pytest.raises(QuantFormatError, match="float32"):
        matmul(w, T.Q4_K, np.zeros((1, 256), np.float64))
    with pytest.raises(QuantFormatError, match="not whole Q8_0 blocks"):
        matmul(w, T.Q8_0, np.zeros((1, 256), np.float32))
    with pytest.raises(QuantFormatError, match=r"out must be a writeable C-contiguous float32\[1, 4\]"):
        matmul(w, T.Q4_K, np.zeros((1, 256), np.float32), out=np.zeros((4, 1), np.float32))
    with pytest.raises(QuantFormatError, match="Q8_K is not supported"):
        matmul(w, T.Q8_K, np.zeros((1, 256), np.float32))


# ---------------------------------------------------------------------------------------------
# real tensors


@pytest.fixture(scope="module")
def qwen_gguf(qwen_path):
    gf = GGUFFile(qwen_path)
    yield gf
    gf.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    "blk.0.attn_q.weight",      # Q5_0 896 x 896
    "blk.0.attn_v.weight",      # Q8_0 128 x 896
    "blk.0.ffn_down.weight",    # Q6_K 896 x 4864
    "blk.11.ffn_down.weight",   # Q4_K 896 x 4864
    "blk.0.attn_q.bias",        # F32 (one row)
])
@pytest.mark.parametrize("n_tokens", [1, 9])
def test_real_tensors(qwen_gguf, name, n_tokens):
    info = qwen_gguf.tensors[name]
    w = qwen_gguf.tensor_rows(name)
    w = w.reshape(-1, w.shape[-1]) if w.ndim == 2 else w.reshape(1, -1)
    x = np.random.default_rng(n_tokens).normal(0, 1, (n_tokens, info.shape[0])).astype(np.float32)
    out = matmul(w, info.ggml_type, x)
    ref = ggml_reference(w, info.ggml_type, x)
    scale = np.abs(x.astype(np.float64)) @ np.abs(dequantize(w, info.ggml_type).astype(np.float64)).T
    assert (np.abs(out - ref) <= 1e-5 * scale).all()


@pytest.mark.parametrize("t", [T.Q5_0, T.Q8_0, T.Q6_K, T.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n_tokens", [1, 4, 9])
def test_extreme_codes_and_quants(t, n_tokens):
    """Weight codes and scales at the ends of their ranges (Q8_0 -128 / 127, Q5_0 0 / 31, Q6_K
    codes 0 / 63 with scales -128 / 127) against activation quants of +-127: the largest integer
    sums the kernels form (VNNI paths: unsigned codes plus offsets, vpmaddubsw pair sums) stay
    exact, bit for bit as the numpy model of llama.cpp. Q4_K also with R = 16, which takes the
    repacked structure (8-row tiles: GEMM for T - T % 4 rows, GEMV for the rest)."""
    rng = np.random.default_rng(11)
    K = 512
    for R in (13, 16) if t == T.Q4_K else (13,):
        w = random_weights(t, R, K, rng)
        block, size = GGML_QUANT_SIZES[t]
        raw = w.reshape(R, K // block, size)
        ends = rng.integers(0, 2, raw.shape, dtype=np.uint8) * np.uint8(0xFF)  # all bits clear or set
        fields = {T.Q5_0: slice(2, 22), T.Q8_0: slice(2, 34), T.Q6_K: slice(0, 208), T.Q4_K: slice(4, 144)}[t]
        raw[..., fields] = ends[..., fields]
        signed = {T.Q8_0: slice(2, 34), T.Q6_K: slice(192, 208)}.get(t)  # int8 quants / scales: -128 or 127
        if signed is not None:
            raw[..., signed] = np.where(ends[..., signed] != 0, 0x80, 0x7F).astype(np.uint8)
        x = np.where(rng.integers(0, 2, (n_tokens, K)) == 1, 1.0, -1.0).astype(np.float32)  # quants +-127
        assert_same_bits(matmul(w, t, x), reference_matmul(w, t, x), f"{t.name} R={R} T={n_tokens}")
