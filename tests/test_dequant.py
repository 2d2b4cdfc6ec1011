"""Dequantization kernels: bit-exact against gguf.quants.dequantize (random, edge-case, real blocks)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants

from edge.gguf_file import GGUFFile
from kernels_cpu.dequant import KERNELS, QuantFormatError, dequantize, dequantize_rows

ALL_TYPES = list(KERNELS)

# byte offsets of the f16 scale fields inside one block of each type (ggml-common.h)
F16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ4_NL: (0,), T.IQ4_XS: (0,),
    T.IQ1_S: (0,), T.TQ1_0: (52,), T.TQ2_0: (64,),  # IQ1_M: its f16 d is spread over the scales' top nibbles
    T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,),
}
# zero, -0, subnormals, smallest normal, f16 max, +-Inf, quiet and signalling NaNs, +-1
EDGE_F16 = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x8001, 0x0400, 0x7BFF, 0xFBFF,
                     0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE00, 0x3C00, 0xBC00], dtype=np.uint16)


def reference(raw: np.ndarray, t: T) -> np.ndarray:
    with np.errstate(all="ignore"):  # Inf * 0 and NaN scales are part of the test
        return np.asarray(quants.dequantize(raw, t), dtype=np.float32)


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    """Bit-equal floats, except that any NaN equals any NaN: a NaN's payload and sign come from
    whichever operand the CPU's vector multiply takes first (IEEE 754 leaves it unspecified, and
    LLVM orders the operands differently on AVX2 and AVX-512); ggml promises no payload either."""
    assert got.dtype == np.float32 and got.shape == want.shape
    bits_differ = got.view(np.uint32) != want.view(np.uint32)
    diff = np.flatnonzero(bits_differ & ~(np.isnan(got) & np.isnan(want)))
    assert diff.size == 0, (f"{diff.size} values differ, first at flat index {diff[0]}: "
                            f"{got.reshape(-1)[diff[0]]!r} vs {want.reshape(-1)[diff[0]]!r}")


def random_blocks(t: T, n_blocks: int, seed: int) -> np.ndarray:
    """Random bytes for n_blocks blocks; every f16 scale field set to an edge-case value."""
    rng = np.random.default_rng(seed)
    type_size = GGML_QUANT_SIZES[t][1]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if t in F16_FIELDS:
        for off in F16_FIELDS[t]:
            raw[:, off:off + 2] = rng.choice(EDGE_F16, size=n_blocks).view(np.uint8).reshape(n_blocks, 2)
    elif t in (T.F16, T.BF16):
        values = raw.view(np.uint16).reshape(-1)
        values[: EDGE_F16.size] = EDGE_F16
    return raw


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_random_blocks_bit_exact(t):
    raw = random_blocks(t, 512, seed=int(t))
    assert_same_bits(dequantize(raw, t), reference(raw, t))


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_plain_scales_bit_exact(t):
    """Finite, moderate scales (the common case), rows of 3 blocks in a 3-D array."""
    rng = np.random.default_rng(100 + int(t))
    raw = random_blocks(t, 3 * 4 * 5, seed=200 + int(t))
    for off in F16_FIELDS.get(t, ()):
        raw[:, off:off + 2] = rng.normal(0, 0.05, raw.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if t == T.IQ1_M:  # clear bit 14 of d (bit 14 of scales[3]): exponent <= 15, |d| < 2
        raw[:, 55] &= 0xBF
    if t == T.MXFP4:  # e8m0 exponent byte: 2**-27 .. 2**12
        raw[:, 0] = rng.integers(100, 140, raw.shape[0])
    raw = raw.reshape(4, 5, -1)
    got = dequantize(raw, t)
    assert got.shape == (4, 5, 3 * GGML_QUANT_SIZES[t][0])
    assert np.isfinite(got).all() or t in (T.F32, T.F16, T.BF16)
    assert_same_bits(got, reference(raw, t))


def test_known_values():
    """Hand-built blocks with values worked out from the ggml layouts."""
    q8 = np.zeros(34, np.uint8)
    q8[:2] = np.array([0.5], np.float16).view(np.uint8)
    q8[2:] = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    np.testing.assert_array_equal(dequantize(q8, "Q8_0"), np.arange(-16, 16) * 0.5)

    q4 = np.zeros(18, np.uint8)
    q4[:2] = np.array([2.0], np.float16).view(np.uint8)
    q4[2:] = 0x9F  # low nibble 15 -> values 0..15, high nibble 9 -> values 16..31
    np.testing.assert_array_equal(dequantize(q4, T.Q4_0), [14.0] * 16 + [2.0] * 16)

    q4k = np.zeros(144, np.uint8)
    q4k[0:4] = np.array([1.0, 0.25], np.float16).view(np.uint8)  # d, dmin
    q4k[4] = 3  # scale of sub-block 0
    q4k[8] = 2  # min of sub-block 0
    q4k[16:48] = 0x75  # sub-block 0: q = 5, sub-block 1: q = 7 (scale 0, min 0)
    got = dequantize(q4k, T.Q4_K)
    np.testing.assert_array_equal(got[:32], 3 * 5 - 0.5)
    np.testing.assert_array_equal(got[32:], 0.0)


def test_zero_block_is_zero():
    """All-zero bytes give zeros (-0.0 where q - offset < 0, as in ggml: 0 * -8 = -0)."""
    for t in ALL_TYPES:
        raw = np.zeros(GGML_QUANT_SIZES[t][1] * 2, np.uint8)
        got = dequantize(raw, t)
        assert got.size == 2 * GGML_QUANT_SIZES[t][0]
        assert not got.any(), t.name
        assert_same_bits(got, reference(raw, t))


def test_errors():
    with pytest.raises(QuantFormatError, match="not a whole number of Q4_K blocks"):
        dequantize(np.zeros(145, np.uint8), T.Q4_K)
    with pytest.raises(QuantFormatError, match="uint8"):
        dequantize(np.zeros(34, np.int8), T.Q8_0)
    with pytest.raises(QuantFormatError, match="C-contiguous"):
        dequantize(np.zeros((34, 2), np.uint8).T, T.Q8_0)
    with pytest.raises(QuantFormatError, match="Q8_K is not supported"):
        dequantize(np.zeros(292, np.uint8), T.Q8_K)
    with pytest.raises(QuantFormatError, match="unknown GGML type"):
        dequantize(np.zeros(34, np.uint8), 999)
    with pytest.raises(QuantFormatError, match="n_elements=33"):
        dequantize(np.zeros(34, np.uint8), T.Q8_0, n_elements=33)
    assert dequantize(np.zeros(34, np.uint8), "q8_0", n_elements=32).shape == (32,)


@pytest.mark.parametrize("t", [T.Q5_0, T.Q6_K, T.F16], ids=lambda t: t.name)
def test_dequantize_rows(t):
    raw = random_blocks(t, 40 * 4, seed=7).reshape(40, -1)
    ids = np.array([3, 0, 39, 3, 17], np.int64)
    out = np.full((ids.size, 4 * GGML_QUANT_SIZES[t][0]), np.nan, np.float32)
    assert dequantize_rows(raw, t, ids, out) is out
    assert_same_bits(out, reference(raw, t)[ids])


def test_dequantize_rows_errors():
    raw = np.zeros((4, 34), np.uint8)
    out = np.zeros((1, 32), np.float32)
    with pytest.raises(IndexError, match="row id 4 out of range for 4 rows"):
        dequantize_rows(raw, T.Q8_0, np.array([4]), out)
    with pytest.raises(IndexError, match="row id -1"):
        dequantize_rows(raw, T.Q8_0, np.array([-1]), out)
    with pytest.raises(QuantFormatError, match=r"float32\[2, 32\]"):
        dequantize_rows(raw, T.Q8_0, np.array([0, 1]), out)
    with pytest.raises(QuantFormatError, match="integer"):
        dequantize_rows(raw, T.Q8_0, np.array([0.0]), out)


# ---------------------------------------------------------------------------------------------
# real tensors


@pytest.fixture(scope="module")
def qwen_gguf(qwen_path):
    gf = GGUFFile(qwen_path)
    yield gf
    gf.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    "blk.0.attn_norm.weight",   # F32
    "blk.0.attn_q.weight",      # Q5_0
    "blk.0.attn_v.weight",      # Q8_0
    "blk.0.ffn_down.weight",    # Q6_K
    "blk.11.ffn_down.weight",   # Q4_K
    "token_embd.weight",        # Q5_0, 151936 rows (a slice)
    "output.weight",            # Q8_0, 151936 rows (a slice)
])
def test_real_tensors(qwen_gguf, name):
    info = qwen_gguf.tensors[name]
    rows = qwen_gguf.tensor_rows(name)
    if rows.shape[0] > 4096:
        rows = np.ascontiguousarray(np.concatenate([rows[:1024], rows[-1024:]]))
    got = dequantize(rows, info.ggml_type)
    assert got.shape == (rows.shape[0], info.shape[0])
    assert_same_bits(got, reference(rows, info.ggml_type))
