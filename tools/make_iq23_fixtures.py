"""Write tests/data/iq23.npz: ggml's own dequantization and vec_dot results for IQ2_XXS, IQ2_XS,
IQ2_S, IQ3_XXS and IQ3_S, for tests/test_iq23.py to hold kernels_cpu.iq23 to them bit for bit.

Run with the oracle interpreter (a llama-cpp-python built on this AVX2 machine) from the
repository root:

    ~/.cache/edge-oracle/llama-cpp-python-0.3.36/venv/bin/python tools/make_iq23_fixtures.py

Through ctypes: libggml-base.so ggml_get_type_traits(type)->to_float (dequantize_row_*) and
libggml-cpu.so ggml_get_type_traits_cpu(type)->vec_dot (ggml_vec_dot_*_q8_K) on activations
quantized by ggml_get_type_traits_cpu(Q8_K)->from_float (quantize_row_q8_K). ggml_mul_mat runs
that same vec_dot per activation row for T < 8 (no tinyBLAS, no repack for these types); for
T >= 8 it takes ggml-cpu/tiled (ggml_tiled_min_batch), whose last bits differ: both stored.

Stored per type NAME: NAME_deq_raw uint8[n, type_size] (random blocks with realistic f16
scales, an all-zero block, subnormal and f16-max scales), NAME_deq_out float32[n, 256];
NAME_w uint8[R, row_bytes], NAME_out float32[T, R] (vec_dot), NAME_mm<T> float32[T, R] (ggml_mul_mat
through a graph, T in GRAPH_T); shared x float32[T, K].
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_matmul_fixtures import GgmlMatmul

ROOT = Path(__file__).resolve().parents[1]
GRAPH_T = (2, 5, 8, 11)  # batches also run through ggml_mul_mat in a graph (2 threads)
# name -> (ggml type id, bytes per block); the f16 d is the first field of each block
TYPES = {"IQ2_XXS": (16, 66), "IQ2_XS": (17, 74), "IQ3_XXS": (18, 98), "IQ3_S": (21, 110), "IQ2_S": (22, 82)}
Q8_K = 15
K, R, T = 1024, 9, 11


class _Traits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p), ("from_float_ref", ctypes.c_void_p)]


class _TraitsCpu(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


_CONV = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _libs():
    import llama_cpp
    libdir = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(libdir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(libdir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    base.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TraitsCpu)
    cpu.ggml_cpu_init()  # fills the f16 -> f32 table the vec_dots read d through
    return base, cpu


def _blocks(rng, n, size, d_bits):
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    raw[:, 0:2] = np.asarray(d_bits, np.uint16).reshape(-1, 1).view(np.uint8)
    return raw


def main():
    graph = GgmlMatmul()
    base, cpu = _libs()
    rng = np.random.default_rng(23)
    data = {}
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[3, 256:512] = 0  # an all-zero Q8_K block
    data["x"] = x
    q8 = cpu.ggml_get_type_traits_cpu(Q8_K).contents
    q8_bytes = K // 256 * 292
    xq = np.zeros((T, q8_bytes), np.uint8)
    for t in range(T):
        _CONV(q8.from_float)(x[t].ctypes.data, xq[t].ctypes.data, K)
    for name, (tid, size) in TYPES.items():
        to_float = _CONV(base.ggml_get_type_traits(tid).contents.to_float)
        vec_dot = _DOT(cpu.ggml_get_type_traits_cpu(tid).contents.vec_dot)
        d = np.abs(rng.standard_normal(24) * 0.004 + 0.002).astype(np.float16).view(np.uint16)
        d = np.concatenate([d, [0, 1, 0x03FF, 0x7BFF, 0xFBFF, 0x8001]]).astype(np.uint16)
        raw = _blocks(rng, d.size, size, d)
        raw[24] = 0  # all-zero block
        out = np.zeros((raw.shape[0], 256), np.float32)
        for i in range(raw.shape[0]):
            to_float(raw[i].ctypes.data, out[i].ctypes.data, 256)
        data[f"{name}_deq_raw"], data[f"{name}_deq_out"] = raw, out
        d = np.abs(rng.standard_normal(R * K // 256) * 0.004 + 0.002).astype(np.float16).view(np.uint16)
        w = _blocks(rng, d.size, size, d).reshape(R, -1)
        w[2, :size] = 0  # an all-zero weight block
        res = np.zeros((T, R), np.float32)
        s = np.zeros(1, np.float32)
        for t in range(T):
            for r in range(R):
                vec_dot(K, s.ctypes.data, 0, w[r].ctypes.data, 0, xq[t].ctypes.data, 0, 1)
                res[t, r] = s[0]
        data[f"{name}_w"], data[f"{name}_out"] = w, res
        for n_t in GRAPH_T:
            mm = graph.matmul(w, tid, K, np.ascontiguousarray(x[:n_t]), repack=False)
            data[f"{name}_mm{n_t}"] = mm
            same = np.array_equal(mm.view(np.uint32), res[:n_t].view(np.uint32))
            print(f"{name} T={n_t}: ggml_mul_mat {'==' if same else '!='} vec_dot per row")
    path = ROOT / "tests" / "data" / "iq23.npz"
    np.savez_compressed(path, **data)
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
