"""IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (kernels_cpu.iq23) against ggml, bit for bit.

Fixture tests/data/iq23.npz from tools/make_iq23_fixtures.py (ggml's to_float and AVX2 vec_dot
through ctypes on this machine's llama.cpp build): dequantized blocks (random, all-zero,
subnormal and f16-max scales), vec_dot results for T = 1..11 activation rows, R = 9, and
ggml_mul_mat graph results for T = 2, 5, 8, 11 (llama.cpp's tiled kernels for T >= 8; the
batch-invariant kernels give the vec_dot arithmetic at every T instead).
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from kernels_cpu.dequant import dequantize
from kernels_cpu.ggml_types import TYPES
from kernels_cpu.matmul import matmul

TYPES_IQ23 = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")
DATA = Path(__file__).parent / "data" / "iq23.npz"


@pytest.fixture(scope="module")
def fx():
    with np.load(DATA) as z:
        return {k: z[k] for k in z.files}


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.mark.parametrize("name", TYPES_IQ23)
def test_rows_match_gguf_sizes(name):
    t = gguf.GGMLQuantizationType[name]
    assert (TYPES[t].block_size, TYPES[t].type_size) == gguf.GGML_QUANT_SIZES[t]
    assert TYPES[t].vec_dot_type == gguf.GGMLQuantizationType.Q8_K


@pytest.mark.parametrize("name", TYPES_IQ23)
def test_dequant_matches_ggml_and_gguf(fx, name):
    raw, ref = fx[f"{name}_deq_raw"], fx[f"{name}_deq_out"]
    out = dequantize(raw, name)
    assert np.array_equal(_bits(out), _bits(ref))
    g = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    assert np.array_equal(_bits(out), _bits(g))
    d = raw[:, :2].copy().view(np.uint16).ravel()
    assert 0x7BFF in d and 0x0001 in d and (ref[24] == 0).all()  # f16-max, subnormal and all-zero blocks


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("name", TYPES_IQ23)
def test_matmul_matches_ggml_vec_dot(fx, name, batch_invariant):
    w, ref, x = fx[f"{name}_w"], fx[f"{name}_out"], fx["x"]
    for T in (1, 2, 5, 8, 11) if batch_invariant else (1, 2, 5):
        for R in (9, 8):
            out = matmul(w[:R], name, x[:T], batch_invariant=batch_invariant)
            assert np.array_equal(_bits(out), _bits(ref[:T, :R])), (T, R)


@pytest.mark.parametrize("name", TYPES_IQ23)
def test_matmul_matches_ggml_mul_mat_small_batches(fx, name):
    w, x = fx[f"{name}_w"], fx["x"]
    for T in (2, 5):
        assert np.array_equal(_bits(matmul(w, name, x[:T])), _bits(fx[f"{name}_mm{T}"])), T


@pytest.mark.parametrize("name", TYPES_IQ23)
def test_matmul_matches_ggml_mul_mat_tiled(fx, name):
    w, x = fx[f"{name}_w"], fx["x"]
    for T in (8, 11):
        assert np.array_equal(_bits(matmul(w, name, x[:T])), _bits(fx[f"{name}_mm{T}"])), T
