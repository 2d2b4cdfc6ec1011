"""kernels_cpu.kquant_int8's K-quant tiles (AVX2 without VNNI, arm64 DotProd) against the generic
tiles, bit for bit, on this machine without a second numba target: both built into one llvmlite
module, compiled for the host and called through ctypes on random and extreme blocks. On an
x86-64 host the int8 tiles take their AVX2 form (vpmaddubsw + vpmaddwd), whatever kernel path
the host's own matmuls take; tests/test_matmul.py and tools/check_targets.py cover the same
tiles inside numba under NUMBA_CPU_NAME=haswell."""
from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from kernels_cpu import simd
from kernels_cpu.matmul_decoders import FORMATS
from kernels_cpu.matmul_tiles import GEMM, GEMV, PATH_NAMES, TILED, VEC_DOT, build_tile

llvm = pytest.importorskip("llvmlite.binding")

if platform.machine().lower() not in ("x86_64", "amd64") or "+avx2" not in llvm.get_host_cpu_features().flatten():
    pytest.skip("the x86 form of kquant_int8's tiles needs an AVX2 host", allow_module_level=True)

from kernels_cpu.kquant_int8 import build_kquant_rows_tile, build_kquant_tile  # noqa: E402
from llvmlite import ir  # noqa: E402

F16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
# (type, path, nr, nt, x16, kind): the one-row-per-vector tiles on every path they serve (an odd
# tile shape too), the 8-row Q4_K tiles as matmul_tiling runs them
CASES = ([(t, VEC_DOT, nr, nt, False, "vec") for t in F16_FIELDS for nr, nt in ((4, 1), (2, 3))]
         + [(t, TILED, 4, 4, False, "vec") for t in F16_FIELDS]
         + [(t, p, 4, 4, False, "vec") for t in (T.Q2_K, T.Q4_K) for p in (GEMV, GEMM)]
         + [(T.Q4_K, GEMV, 8, 1, False, "rows"), (T.Q4_K, GEMM, 8, 4, False, "rows"), (T.Q4_K, GEMV, 8, 4, True, "rows"),
            (T.Q6_K, VEC_DOT, 4, 1, True, "vec"), (T.Q3_K, TILED, 2, 3, True, "vec")])


@pytest.fixture(scope="module")
def tiles():
    """name -> (generic tile, int8 tile) ctypes functions, compiled for the host."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    module = ir.Module("kquant_int8_test")
    module.triple = llvm.get_process_triple()
    for k, (t, path, nr, nt, x16, kind) in enumerate(CASES):
        fns = [build_tile(module, FORMATS[t], path, nr, nt, f"generic{k}", x16)]
        if kind == "rows":
            fns.append(build_kquant_rows_tile(module, t, path, nt, f"int8_{k}", x16))
        else:
            fns.append(build_kquant_tile(module, t, path, nr, nt, f"int8_{k}", x16))
        for fn in fns:
            fn.linkage = "external"
    parsed = llvm.parse_assembly(str(module))
    parsed.verify()
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=2)
    engine = llvm.create_mcjit_compiler(parsed, machine)
    engine.finalize_object()
    proto = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p, ctypes.c_int64] * 4 + [ctypes.c_void_p] + [ctypes.c_int64] * 3))
    out = {k: tuple(proto(engine.get_function_address(f"{p}{k}")) for p in ("generic", "int8_"))
           for k in range(len(CASES))}
    out["engine"] = engine  # keeps the code alive
    return out


def _blocks(t, rows: int, nb: int, rng, extreme: bool) -> np.ndarray:
    """uint8[rows, nb * block bytes]: random codes, or every code and scale at an end of its range."""
    size = GGML_QUANT_SIZES[t][1]
    raw = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    if extreme:
        raw = rng.integers(0, 2, raw.shape, dtype=np.uint8) * np.uint8(0xFF)
        if t == T.Q6_K:  # int8 scales -128 / 127
            raw[..., 192:208] = np.where(raw[..., 192:208] != 0, 0x80, 0x7F).astype(np.uint8)
    for off in F16_FIELDS[t]:
        raw[..., off:off + 2] = rng.normal(0, 0.02, raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("k", range(len(CASES)),
                         ids=[f"{t.name}-{PATH_NAMES[p]}-{nr}x{nt}{'-x16' if x16 else ''}-{kind}"
                              for t, p, nr, nt, x16, kind in CASES])
def test_int8_tiles_give_the_generic_bits(tiles, k):
    from kernels_cpu.quantize_act import quantize_q8_k

    t, path, nr, nt, x16, kind = CASES[k]
    rng = np.random.default_rng(k)
    nb = 3
    for extreme in (False, True):
        w = _blocks(t, nr, nb, rng, extreme)
        if extreme:  # activation quants +-127
            x = np.where(rng.integers(0, 2, (nt, 256 * nb)) == 1, 1.0, -1.0).astype(np.float32)
        else:
            x = rng.normal(0, 1, (nt, 256 * nb)).astype(np.float32)
            x[:, ::61] *= 20
        qs, d, bsums = quantize_q8_k(x)
        qs = np.ascontiguousarray(qs.astype(np.int16) if x16 else qs)
        outs = []
        for fn in tiles[k]:
            out = np.full((nt, nr), np.nan, np.float32)
            fn(w.ctypes.data, w.strides[0], qs.ctypes.data, qs.strides[0], d.ctypes.data, d.strides[0],
               bsums.ctypes.data, bsums.strides[0], out.ctypes.data, nr, 1, nb)
            outs.append(out)
        assert np.isfinite(outs[0]).all()
        np.testing.assert_array_equal(outs[1].view(np.uint32), outs[0].view(np.uint32),
                                      err_msg=f"extreme={extreme} path={simd.kernel_path()}")
