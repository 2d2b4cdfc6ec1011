"""The x86 int8 tiles against the generic tiles, bit for bit, on this machine without a second
numba target: kernels_cpu.kquant_int8's K-quant tiles and kernels_cpu.matmul_avx2's Q4_0 / Q5_0 /
Q8_0 / Q4_1 / Q5_1 tiles, each in its AVX2 form (vpmaddubsw + vpmaddwd) and its AVX-VNNI form
(vpdpbusd ymm), whatever kernel path the host's own matmuls take: the tiles' modules get the
path's flags while their IR is built (_variant), all tiles go into one llvmlite module, compiled
for the host and called through ctypes on random and extreme blocks. The AVX-VNNI form runs
where the host has vpdpbusd ymm (AVX-512 VNNI + VL: the same LLVM intrinsic, EVEX-encoded; or
AVX-VNNI itself); its encoding for a CPU without AVX-512 is checked on the assembly LLVM emits
for alderlake (test_avx_vnni_tiles_are_vex_encoded). tests/test_matmul.py and
tools/check_targets.py cover the tiles inside numba (under NUMBA_CPU_NAME=haswell for AVX2)."""
from __future__ import annotations

import contextlib
import ctypes
import platform
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from kernels_cpu import simd
from kernels_cpu.ggml_types import TYPES
from kernels_cpu.matmul_decoders import FORMATS
from kernels_cpu.matmul_tiles import GEMM, GEMV, PATH_NAMES, TILED, VEC_DOT, build_tile

llvm = pytest.importorskip("llvmlite.binding")

if platform.machine().lower() not in ("x86_64", "amd64") or "+avx2" not in llvm.get_host_cpu_features().flatten():
    pytest.skip("the x86 form of the int8 tiles needs an AVX2 host", allow_module_level=True)

from kernels_cpu import iq4_avx2, kquant_int8, matmul_avx2  # noqa: E402
from llvmlite import ir  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from check_targets import TARGETS  # noqa: E402

_HOST = set(llvm.get_host_cpu_features().flatten().split(","))
# the host runs vpdpbusd ymm: AVX-512 VNNI + VL (EVEX) or AVX-VNNI (VEX)
VPDPBUSD_YMM = {"+avx512vnni", "+avx512vl"} <= _HOST or "+avxvnni" in _HOST
VARIANTS = ("avx2", "avx-vnni")
# (type, path, nr, nt, x16, kind): the one-row-per-vector K-quant tiles on every path they serve
# (an odd tile shape too), the 8-row Q4_K tiles as matmul_tiling runs them, matmul_avx2's tiles
# ("q0": decode and prefill shapes)
SHAPES = ([(t, VEC_DOT, nr, nt, False, "vec") for t in kquant_int8.KQUANT_TYPES for nr, nt in ((4, 1), (2, 3))]
          + [(t, TILED, 4, 4, False, "vec") for t in kquant_int8.KQUANT_TYPES]
          + [(t, p, 4, 4, False, "vec") for t in (T.Q2_K, T.Q4_K) for p in (GEMV, GEMM)]
          + [(T.Q4_K, GEMV, 8, 1, False, "rows"), (T.Q4_K, GEMM, 8, 4, False, "rows"),
             (T.Q4_K, GEMV, 8, 4, True, "rows"), (T.Q6_K, VEC_DOT, 4, 1, True, "vec"),
             (T.Q3_K, TILED, 2, 3, True, "vec")]
          + [(T[n], VEC_DOT, nr, nt, x16, "q0") for n in matmul_avx2.AVX2_TYPES
             for nr, nt, x16 in ((4, 1, False), (4, 4, True))])
CASES = [(v, *s) for v in VARIANTS for s in SHAPES]
# the kinds of tile whose AVX-VNNI form takes vpdpbusd: the K-quant tiles of one row per vector
# keep vpmaddubsw + vpmaddwd (their step is scaled per 32 values: one vpdpbusd then vpmulld by the
# scales measured slower; kernels_cpu.kquant_int8's docstring)
VPDPBUSD_KINDS = {"q0", "rows"}


@contextlib.contextmanager
def _variant(name: str):
    """The tile modules' path flags as simd sets them on an AVX2 ("avx2") or AVX-VNNI ("avx-vnni")
    CPU without AVX-512 VNNI, while a tile's IR is built (they are read then)."""
    with pytest.MonkeyPatch.context() as mp:
        for mod in (kquant_int8, matmul_avx2, iq4_avx2):
            mp.setattr(mod, "HAS_AVX_VNNI", name == "avx-vnni")
            for flag in ("HAS_VNNI", "HAS_DOTPROD"):
                if hasattr(mod, flag):
                    mp.setattr(mod, flag, False)
        yield


def _int8_tile(module, variant, t, path, nr, nt, x16, kind, name):
    with _variant(variant):
        if kind == "rows":
            return kquant_int8.build_kquant_rows_tile(module, t, path, nt, name, x16)
        if kind == "q0":
            return matmul_avx2.build_avx2_tile(module, t.name, nr, nt, name, x16)
        return kquant_int8.build_kquant_tile(module, t, path, nr, nt, name, x16)


@pytest.fixture(scope="module")
def tiles():
    """case index -> (generic tile, int8 tile) ctypes functions, compiled for the host (the
    AVX-VNNI cases only where the host runs vpdpbusd ymm)."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    module = ir.Module("kquant_int8_test")
    module.triple = llvm.get_process_triple()
    built = [k for k, case in enumerate(CASES) if case[0] == "avx2" or VPDPBUSD_YMM]
    for k in built:
        variant, t, path, nr, nt, x16, kind = CASES[k]
        fns = [build_tile(module, FORMATS[t], path, nr, nt, f"generic{k}", x16),
               _int8_tile(module, variant, t, path, nr, nt, x16, kind, f"int8_{k}")]
        for fn in fns:
            fn.linkage = "external"
    parsed = llvm.parse_assembly(str(module))
    parsed.verify()
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=2)
    engine = llvm.create_mcjit_compiler(parsed, machine)
    engine.finalize_object()
    proto = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p, ctypes.c_int64] * 4 + [ctypes.c_void_p] + [ctypes.c_int64] * 3))
    out = {k: tuple(proto(engine.get_function_address(f"{p}{k}")) for p in ("generic", "int8_")) for k in built}
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
        if t == T.Q8_0:  # codes -128 / 127
            raw[..., 2:] = np.where(raw[..., 2:] != 0, 0x80, 0x7F).astype(np.uint8)
    for off in TYPES[t].f16_scales:
        raw[..., off:off + 2] = rng.normal(0, 0.02, raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("k", range(len(CASES)),
                         ids=[f"{v}-{t.name}-{PATH_NAMES[p]}-{nr}x{nt}{'-x16' if x16 else ''}-{kind}"
                              for v, t, p, nr, nt, x16, kind in CASES])
def test_int8_tiles_give_the_generic_bits(tiles, k):
    from kernels_cpu.quantize_act import quantize_q8_1, quantize_q8_k

    variant, t, path, nr, nt, x16, kind = CASES[k]
    if k not in tiles:
        pytest.skip("the host has no vpdpbusd ymm (AVX-512 VNNI + VL or AVX-VNNI)")
    rng = np.random.default_rng(k)
    nb = 3
    block = TYPES[t].block_size
    for extreme in (False, True):
        w = _blocks(t, nr, nb, rng, extreme)
        if extreme:  # activation quants +-127
            x = np.where(rng.integers(0, 2, (nt, block * nb)) == 1, 1.0, -1.0).astype(np.float32)
        else:
            x = rng.normal(0, 1, (nt, block * nb)).astype(np.float32)
            x[:, ::61] *= 20
        qs, d, xa = quantize_q8_1(x) if kind == "q0" else quantize_q8_k(x)  # xa: Q8_1 sums (Q4_1 / Q5_1), Q8_K bsums
        qs = np.ascontiguousarray(qs.astype(np.int16) if x16 else qs)
        outs = []
        for fn in tiles[k]:
            out = np.full((nt, nr), np.nan, np.float32)
            fn(w.ctypes.data, w.strides[0], qs.ctypes.data, qs.strides[0], d.ctypes.data, d.strides[0],
               xa.ctypes.data, xa.strides[0], out.ctypes.data, nr, 1, nb)
            outs.append(out)
        assert np.isfinite(outs[0]).all()
        np.testing.assert_array_equal(outs[1].view(np.uint32), outs[0].view(np.uint32),
                                      err_msg=f"extreme={extreme} host path={simd.kernel_path()}")


def _functions(asm: str) -> dict:
    """Assembly text -> {function name: its body} (external functions, as LLVM's x86 AT&T output)."""
    out = {}
    for m in re.finditer(r"^(\w+):\n(.*?)^\.Lfunc_end", asm, re.S | re.M):
        out[m.group(1)] = m.group(2)
    return out


def test_avx_vnni_tiles_are_vex_encoded():
    """The AVX-VNNI tiles compiled for alderlake (tools/check_targets.py's features: AVX-VNNI, no
    AVX-512) take ``{vex} vpdpbusd`` ymm where VPDPBUSD_KINDS says (and IQ4_NL / MXFP4; IQ4_XS
    ``{vex} vpdpwssd``), every VNNI instruction VEX-encoded, and nothing of AVX-512: no zmm
    register, no ymm16-31, no mask register, no embedded broadcast; the AVX2 tiles no vpdpbusd."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    module = ir.Module("avx_vnni_asm")
    module.triple = llvm.get_process_triple()
    names = {}
    for k, (variant, t, path, nr, nt, x16, kind) in enumerate(CASES):
        names[f"tile{k}"] = (variant, kind)
        _int8_tile(module, variant, t, path, nr, nt, x16, kind, f"tile{k}").linkage = "external"
    iq4 = [(T.IQ4_NL, VEC_DOT, "vpdpbusd"), (T.MXFP4, VEC_DOT, "vpdpbusd"), (T.IQ4_XS, VEC_DOT, "vpdpwssd"),
           (T.IQ4_XS, TILED, "vpdpwssd"), (T.IQ4_NL, GEMV, "vpdpbusd")]
    for k, (t, path, op) in enumerate(iq4):
        for variant in VARIANTS:
            name = f"iq4_{variant.replace('-', '_')}{k}"
            with _variant(variant):
                iq4_avx2.build_avx2_iq4_tile(module, t, path, 4, 2, name, False).linkage = "external"
            names[name] = (variant, op)
    cpu, features = TARGETS["alderlake"]
    assert "+avxvnni" in features and "avx512" not in features
    parsed = llvm.parse_assembly(str(module))
    parsed.verify()
    machine = llvm.Target.from_default_triple().create_target_machine(cpu=cpu, features=features, opt=2)
    asm = machine.emit_assembly(parsed)
    bodies = _functions(asm)
    assert set(bodies) == set(names)
    for name, (variant, what) in names.items():
        body = bodies[name]
        vnni = re.findall(r"^\s*(\{vex\}\s+)?(vpdpbusds?|vpdpwssds?)\b", body, re.M)
        assert all(prefix for prefix, _ in vnni), (name, "a VNNI instruction without {vex}")
        ops = {op for _, op in vnni}
        if variant == "avx2":  # (LLVM itself may fuse a vpmaddwd and its add into vpdpwssd for this CPU)
            assert "vpdpbusd" not in ops, name
        elif what in ("vpdpbusd", "vpdpwssd"):
            assert what in ops, (name, ops)
        else:
            assert ("vpdpbusd" in ops) == (what in VPDPBUSD_KINDS), (name, ops)
        assert not re.search(r"%zmm|%k[0-7]\b|\{1to|\{z\}|%[xy]mm(1[6-9]|2\d|3[01])\b", body), (name, "AVX-512")
