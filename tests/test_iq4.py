"""IQ4_NL, IQ4_XS and MXFP4 against ggml (tests/data/iq4.npz from tools/make_iq4_fixtures.py):
dequantization bit for bit as ggml's to_float and gguf.quants.dequantize, matmuls bit for bit as
ggml_mul_mat (plain CPU buffer: vec_dot / tinyBLAS / tiled; CPU_REPACK buffer: iq4_nl_8x8 and
mxfp4_8x8 gemv / gemm), and the engine's entry points (matmul routing, batch_invariant)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from kernels_cpu.dequant import dequantize, dequantize_rows
from kernels_cpu.matmul import matmul, quantize_activations
from kernels_cpu.matmul_kernels import QUANT_KERNELS, REPACKED_KERNELS

DATA = np.load(Path(__file__).parent / "data" / "iq4.npz")
NAMES = ("IQ4_NL", "IQ4_XS", "MXFP4")
CASES = [str(c) for c in DATA["cases"]]


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("name", NAMES)
def test_dequant_matches_ggml_and_gguf(name):
    raw, want = DATA[f"dq_{name}_raw"], DATA[f"dq_{name}_out"]
    got = dequantize(raw, T[name])
    assert np.array_equal(bits(got), bits(want))
    with np.errstate(over="ignore"):  # MXFP4 e = 255: 2**127 * 12 overflows to inf in both
        ref = np.asarray(quants.dequantize(raw, T[name]), np.float32).reshape(-1)
    assert np.array_equal(bits(got), bits(ref))
    assert np.isinf(got).any() == (name == "MXFP4")  # the e8m0 255 block reaches inf


def test_dequant_rows_gathers():
    raw = DATA["dq_IQ4_XS_raw"].reshape(-1, 136 * 2)  # rows of 512 values
    out = np.empty((2, 512), np.float32)
    dequantize_rows(raw, T.IQ4_XS, [3, 0], out)
    assert np.array_equal(bits(out[0]), bits(dequantize(raw[3], T.IQ4_XS)))


def _case(case):
    w = DATA[str(DATA[f"{case}_w"])]
    x = np.ascontiguousarray(DATA[str(DATA[f"{case}_x"])][: int(DATA[f"{case}_T"])])
    return w, T(int(DATA[f"{case}_type"])), x, DATA[f"{case}_out"]


@pytest.mark.parametrize("case", CASES)
def test_matmul_matches_ggml(case):
    w, t, x, want = _case(case)
    if "_repacked" in case or w.shape[0] % 8:  # what matmul picks: llama.cpp's loader's buffer
        got = matmul(w, t, x)
    else:  # plain-buffer fixture of a repackable shape: the plain kernel itself
        xq = quantize_activations(t, x)
        got = np.empty(want.shape, np.float32)
        QUANT_KERNELS[t](w, *xq.arrays, got)
    diff = np.flatnonzero(bits(got) != bits(want))
    assert diff.size == 0, f"{diff.size}/{want.size} differ, max {np.abs(got - want).max()}"


def test_routing():
    assert set(REPACKED_KERNELS) >= {T.IQ4_NL, T.MXFP4} and T.IQ4_XS not in REPACKED_KERNELS


@pytest.mark.parametrize("case", [f"mm_{n}_R{r}_T11" for n in NAMES for r in (6, 16)])
def test_batch_invariant_rows(case):
    """batch_invariant=True: row t of a batch equals the same row computed alone, which is
    llama.cpp's result for a batch of one (the T = 1 fixture)."""
    w, t, x, _ = _case(case)
    if w.shape[0] % 8 == 0:
        w = w[:7]  # not repacked: the plain kernels, whose llama.cpp arithmetic depends on T
    assert np.array_equal(bits(matmul(w, t, x[:1], batch_invariant=True)), bits(_case(case[:-3] + "T1")[3][:, :7]))
    batch = matmul(w, t, x, batch_invariant=True)
    for r in (0, 4, 10):
        alone = matmul(w, t, np.ascontiguousarray(x[r:r + 1]), batch_invariant=True)
        assert np.array_equal(bits(batch[r]), bits(alone[0]))


@pytest.mark.parametrize("native", [False, True])
def test_lookup16_portable_and_native(native):
    """lookup16's two forms (vpshufb; compare-and-select for CPUs without AVX2) give table[idx]
    for every index, each table (kvalues_iq4nl, kvalues_mxfp4), JIT-compiled with llvmlite."""
    import ctypes

    import llvmlite.binding as llvm
    from llvmlite import ir

    from kernels_cpu.iq4_decoders import HAS_PSHUFB, KVALUES_IQ4NL, KVALUES_MXFP4, lookup16
    from kernels_cpu.simd import BYTE_PTR, I8, load, vec

    if native and not HAS_PSHUFB:
        pytest.skip("no AVX2 on this CPU")
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    rng = np.random.default_rng(7)
    idx = np.concatenate([np.arange(16), rng.integers(0, 16, 16)]).astype(np.int8)
    for table in (KVALUES_IQ4NL, KVALUES_MXFP4):
        m = ir.Module("lookup16")
        m.triple = llvm.get_process_triple()
        fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [BYTE_PTR, BYTE_PTR]), "f")
        b = ir.IRBuilder(fn.append_basic_block())
        v = lookup16(b, table, load(b, fn.args[0], 0, vec(I8, 32)), native)
        b.store(v, b.bitcast(fn.args[1], vec(I8, 32).as_pointer()), align=1)
        b.ret_void()
        tm = llvm.Target.from_default_triple().create_target_machine(
            cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten())
        ee = llvm.create_mcjit_compiler(llvm.parse_assembly(str(m)), tm)
        ee.finalize_object()
        f = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(ee.get_function_address("f"))
        out = np.zeros(32, np.int8)
        f(idx.ctypes.data, out.ctypes.data)
        np.testing.assert_array_equal(out, np.array(table, np.int8)[idx])
