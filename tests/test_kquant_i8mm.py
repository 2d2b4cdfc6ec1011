"""The arm64 I8MM form of kernels_cpu.kquant_int8's 8-row Q4_K tiles (``smmla`` for each pair of
activation rows) against its DotProd form (``sdot``) and the generic tile, bit for bit.

On any host: the tiles' IR, built with the arm64 path flags, compiled by llvmlite for an aarch64
triple (apple-m2 / apple-m1): the I8MM form takes the number of smmla its structure implies and no
sdot for paired rows, the DotProd form none; simd's table of arm64 CPU names agrees with LLVM on
which names have I8MM. On an arm64 target with I8MM (simd.HAS_I8MM; CI: tools/arm64_emulated.sh
with NUMBA_CPU_NAME=apple-m2, qemu-aarch64 runs smmla exactly): the three tiles compiled for numba's
target and called through ctypes on random and extreme blocks give the same bits."""
from __future__ import annotations

import contextlib
import ctypes
import platform
import re
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from kernels_cpu import kquant_int8, simd
from kernels_cpu.ggml_types import TYPES
from kernels_cpu.matmul_decoders import FORMATS
from kernels_cpu.matmul_tiles import GEMM, GEMV, PATH_NAMES, build_tile

llvm = pytest.importorskip("llvmlite.binding")
from llvmlite import ir  # noqa: E402

AARCH64 = "aarch64-unknown-linux-gnu"
# (path, nt, x16): the tiles matmul_tiling runs (8 x 4 GEMM and, batch-invariant, GEMV; 8 x 1 GEMV
# for decode), an odd nt (one pair and one sdot row), one pair, int16 quants
SHAPES = [(GEMM, 4, False), (GEMV, 4, False), (GEMV, 1, False), (GEMM, 3, False), (GEMV, 2, False), (GEMM, 4, True)]
FORMS = ("sdot", "smmla")


@contextlib.contextmanager
def _arm64(form: str):
    """kquant_int8's path flags of an arm64 CPU with DotProd, and I8MM for ``form`` "smmla", while a
    tile's IR is built (they are read then)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kquant_int8, "HAS_DOTPROD", True)
        mp.setattr(kquant_int8, "HAS_I8MM", form == "smmla")
        mp.setattr(kquant_int8, "HAS_AVX_VNNI", False)
        yield


def _rows_tile(module, form, path, nt, x16, name):
    with _arm64(form):
        fn = kquant_int8.build_kquant_rows_tile(module, T.Q4_K, path, nt, name, x16)
    fn.linkage = "external"
    return fn


def _counts(asm: str) -> dict:
    """Assembly text -> {function: Counter of its mnemonics}."""
    out = {}
    for m in re.finditer(r"^(\w+):.*?\n(.*?)^\.Lfunc_end", asm, re.S | re.M):
        out[m.group(1)] = Counter(line.split()[0] for line in m.group(2).splitlines()
                                  if line.startswith("\t") and not line.strip().startswith((".", "//")))
    return out


def test_i8mm_tiles_take_smmla():
    """Compiled for aarch64 apple-m2, the smmla form of each shape has 128 smmla per pair of
    activation rows per block (8 rows x 256 values x 2 rows / 32 multiply-adds) and 128 sdot per
    row left alone, the sdot form (apple-m1) 128 sdot per activation row and no smmla."""
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    target = llvm.Target.from_triple(AARCH64)
    for form, cpu in (("smmla", "apple-m2"), ("sdot", "apple-m1")):
        module = ir.Module(f"q4_k_rows_{form}")
        module.triple = AARCH64
        names = {}
        for k, (path, nt, x16) in enumerate(SHAPES):
            names[f"tile{k}"] = nt
            _rows_tile(module, form, path, nt, x16, f"tile{k}")
        parsed = llvm.parse_assembly(str(module))
        parsed.verify()
        counts = _counts(target.create_target_machine(cpu=cpu, opt=2).emit_assembly(parsed))
        assert set(counts) == set(names)
        for name, nt in names.items():
            pairs = nt // 2 if form == "smmla" else 0
            assert (counts[name]["smmla"], counts[name]["sdot"]) == (128 * pairs, 128 * (nt - 2 * pairs)), (form, name, nt)


_PROBE = """
import sys
import llvmlite.binding as llvm
llvm.initialize_all_targets()
llvm.initialize_all_asmprinters()
ir_text = '''
declare <4 x i32> @llvm.aarch64.neon.smmla.v4i32.v16i8(<4 x i32>, <16 x i8>, <16 x i8>)
define <4 x i32> @f(<4 x i32> %a, <16 x i8> %b, <16 x i8> %c) {
  %r = call <4 x i32> @llvm.aarch64.neon.smmla.v4i32.v16i8(<4 x i32> %a, <16 x i8> %b, <16 x i8> %c)
  ret <4 x i32> %r
}'''
for cpu in sys.argv[1:]:
    m = llvm.parse_assembly(ir_text)
    m.triple = "aarch64-unknown-linux-gnu"
    asm = llvm.Target.from_triple(m.triple).create_target_machine(cpu=cpu, opt=2).emit_assembly(m)
    print(cpu, "smmla" in asm, flush=True)
"""


def test_arm64_cpu_names_with_i8mm_agree_with_llvm():
    """Every arm64 CPU name simd lists with I8MM compiles smmla in this LLVM; each name listed with
    DotProd alone does not (LLVM aborts: "Cannot select"), so HAS_I8MM never emits smmla for a CPU
    without it."""
    with_i8mm = sorted(cpu for cpu, f in simd._ARM64_IMPLIED.items() if "+i8mm" in f)
    without = sorted(cpu for cpu, f in simd._ARM64_IMPLIED.items() if "+i8mm" not in f)
    assert "apple-m2" in with_i8mm and "apple-m1" in without
    proc = subprocess.run([sys.executable, "-c", _PROBE, *with_i8mm], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [w for cpu in with_i8mm for w in (cpu, "True")]
    for cpu in without:
        proc = subprocess.run([sys.executable, "-c", _PROBE, cpu], capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and "Cannot select" in proc.stderr, (cpu, proc.stdout, proc.stderr[-500:])


# ---------------------------------------------------------------------------------------------
# run on an arm64 target with I8MM

_RUNS = platform.machine().lower() in ("aarch64", "arm64") and simd.HAS_I8MM


@pytest.fixture(scope="module")
def tiles():
    """shape index -> (generic 8 x 1 tile, sdot form, smmla form) ctypes functions, compiled for numba's
    target (the generic tile of the path's float structure, one activation row per call: results do not
    depend on the tiling)."""
    if not _RUNS:
        pytest.skip(f"needs an arm64 target with I8MM (this: {platform.machine()}, path {simd.kernel_path()}); "
                    "CI runs it under tools/arm64_emulated.sh with NUMBA_CPU_NAME=apple-m2")
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    module = ir.Module("q4_k_rows_i8mm")
    module.triple = llvm.get_process_triple()
    for k, (path, nt, x16) in enumerate(SHAPES):
        build_tile(module, FORMATS[T.Q4_K], path, 8, 1, f"generic{k}", x16).linkage = "external"  # one row at a time
        for form in FORMS:
            _rows_tile(module, form, path, nt, x16, f"{form}{k}")
    parsed = llvm.parse_assembly(str(module))
    parsed.verify()
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=simd.cpu_target(), features=",".join(sorted(simd.target_features())), opt=2)
    engine = llvm.create_mcjit_compiler(parsed, machine)
    engine.finalize_object()
    proto = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p, ctypes.c_int64] * 4 + [ctypes.c_void_p] + [ctypes.c_int64] * 3))
    out = {k: tuple(proto(engine.get_function_address(f"{p}{k}")) for p in ("generic", *FORMS)) for k in range(len(SHAPES))}
    out["engine"] = engine  # keeps the code alive
    return out


def _q4_k_blocks(rows: int, nb: int, rng, extreme: bool) -> np.ndarray:
    """uint8[rows, nb * 144] Q4_K blocks: random bytes, or every scale, min and code 0 or at its top
    (bytes 0x00 / 0xFF), with f16 d and dmin of a realistic size."""
    raw = rng.integers(0, 256, (rows, nb, GGML_QUANT_SIZES[T.Q4_K][1]), dtype=np.uint8)
    if extreme:
        raw = rng.integers(0, 2, raw.shape, dtype=np.uint8) * np.uint8(0xFF)
    for off in TYPES[T.Q4_K].f16_scales:
        raw[..., off:off + 2] = rng.normal(0, 0.02, raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("k", range(len(SHAPES)),
                         ids=[f"{PATH_NAMES[p]}-8x{nt}{'-x16' if x16 else ''}" for p, nt, x16 in SHAPES])
def test_i8mm_tiles_give_the_generic_bits(tiles, k):
    from kernels_cpu.quantize_act import quantize_q8_k

    path, nt, x16 = SHAPES[k]
    rng = np.random.default_rng(100 + k)
    nb, nr = 3, 8
    for extreme in (False, True):
        w = _q4_k_blocks(nr, nb, rng, extreme)
        if extreme:  # activation quants +-127
            x = np.where(rng.integers(0, 2, (nt, 256 * nb)) == 1, 1.0, -1.0).astype(np.float32)
        else:
            x = rng.normal(0, 1, (nt, 256 * nb)).astype(np.float32)
            x[:, ::61] *= 20
        qs, d, bsums = quantize_q8_k(x)
        qs = np.ascontiguousarray(qs.astype(np.int16) if x16 else qs)
        outs = []
        for f, fn in enumerate(tiles[k]):
            out = np.full((nt, nr), np.nan, np.float32)
            for t in range(nt) if f == 0 else [0]:  # the generic tile: activation row t alone (8 x 1)
                fn(w.ctypes.data, w.strides[0], qs[t:].ctypes.data, qs.strides[0], d[t:].ctypes.data, d.strides[0],
                   bsums[t:].ctypes.data, bsums.strides[0], out[t:].ctypes.data, nr, 1, nb)
            outs.append(out)
        assert np.isfinite(outs[0]).all()
        for form, out in zip(FORMS, outs[1:]):
            np.testing.assert_array_equal(out.view(np.uint32), outs[0].view(np.uint32),
                                          err_msg=f"{form} extreme={extreme} path={simd.kernel_path()}")
