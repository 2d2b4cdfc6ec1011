"""Write tests/data/iq4.npz: ggml's own IQ4_NL / IQ4_XS / MXFP4 dequantization and matmul
results, for tests/test_iq4.py to hold edge's kernels to them bit for bit.

Run with the oracle interpreter (llama-cpp-python built from source) from the repository root:

    ~/.cache/edge-oracle/llama-cpp-python-0.3.36/venv/bin/python tools/make_iq4_fixtures.py

* dequant: random blocks plus edge blocks (all-zero, tiny and huge f16 scales; MXFP4 e8m0
  exponents 0, 1, 2, 127, 254, 255), decoded by libggml-base's ``to_float``
  (ggml_get_type_traits): NAME_raw uint8[n_bytes], NAME_out float32[n].
* matmul: ggml_mul_mat through a graph (tools/make_matmul_fixtures.GgmlMatmul), R = 6 rows in
  the plain CPU buffer and R = 8 / 16 in the CPU_REPACK buffer, T in (1, 2, 5, 8, 11); stored as
  make_matmul_fixtures.Fixtures does (T = 1 is ggml_vec_dot_<type>).
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_matmul_fixtures import Fixtures, GgmlMatmul

ROOT = Path(__file__).resolve().parents[1]
# name -> (ggml type id, values per block, bytes per block)
IQ4_TYPES = {"IQ4_NL": (20, 32, 18), "IQ4_XS": (23, 256, 136), "MXFP4": (39, 32, 17)}
T_VALUES = (1, 2, 5, 8, 11)
REPACKED = ("IQ4_NL", "MXFP4")  # the CPU_REPACK buffer takes them (iq4_nl_8x8, mxfp4_8x8 on AVX2)


def random_blocks(name: str, n_blocks: int, rng, scale: float = 0.02) -> np.ndarray:
    """uint8[n_blocks, block_bytes]: random quants and realistic scales (f16 d, or e8m0 e)."""
    _, _, size = IQ4_TYPES[name]
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    if name == "MXFP4":
        raw[:, 0] = rng.integers(115, 125, n_blocks)  # 2^-12 .. 2^-3
    else:
        raw[:, 0:2] = rng.normal(0, scale, n_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


def edge_blocks(name: str, rng) -> np.ndarray:
    """Blocks at the extremes: zero quants / zero scale, tiny (subnormal) and huge (f16 max) scales."""
    raw = random_blocks(name, 8, rng)
    if name == "MXFP4":
        raw[:, 0] = (0, 1, 2, 127, 254, 255, 0, 128)
        raw[6, 1:] = 0
    else:
        d = np.array([0.0, 6e-8, 1e-5, 65504.0, -65504.0, 1.0, -0.5, 6.1e-5], np.float16)
        raw[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
        raw[0, 2:] = 0
    return raw


class ToFloat:
    """libggml-base ggml_get_type_traits(type)->to_float (dequantize_row_<type>)."""

    def __init__(self, base):
        base.ggml_get_type_traits.restype = ctypes.c_void_p
        base.ggml_get_type_traits.argtypes = [ctypes.c_int]
        self.base = base

    def __call__(self, type_id: int, raw: np.ndarray, n: int) -> np.ndarray:
        traits = self.base.ggml_get_type_traits(type_id)
        fn_ptr = ctypes.c_void_p.from_address(traits + 40).value  # name, blck_size, interleave, type_size, is_quantized
        fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(fn_ptr)
        out = np.empty(n, np.float32)
        raw = np.ascontiguousarray(raw)
        fn(raw.ctypes.data, out.ctypes.data, n)
        return out


def main() -> None:
    rng = np.random.default_rng(17)
    g = GgmlMatmul()
    to_float = ToFloat(g.base)
    fx = Fixtures()
    cases = []
    for name, (type_id, block, size) in IQ4_TYPES.items():
        raw = np.concatenate([random_blocks(name, 24, rng), edge_blocks(name, rng)])
        fx.arrays[f"dq_{name}_raw"] = raw.reshape(-1)
        fx.arrays[f"dq_{name}_out"] = to_float(type_id, raw, raw.shape[0] * block)
        K = 768 if block == 256 else 800  # 25 blocks of 32 (odd: the vec_dot tail); 3 of 256
        x = rng.normal(0, 1, (max(T_VALUES), K)).astype(np.float32)
        x[:, ::61] *= 30  # outliers: block scales differ
        x[1, 256:288] = 0  # an all-zero block
        x[2, 0:64] *= 1e-3
        shapes = ((6, False), (8, True), (16, True), (16, False)) if name in REPACKED else ((6, False), (8, False), (16, False))
        for R, repack in shapes:
            w = random_blocks(name, R * K // block, rng).reshape(R, -1)
            for T in T_VALUES:
                out = g.matmul(w, type_id, K, x[:T].copy(), repack)
                case = f"mm_{name}_R{R}{'_repacked' if repack else ''}_T{T}"
                fx.add(case, w, type_id, x, T, out)
                cases.append(case)
        K2 = 2 * K + block  # even number of 32-blocks for IQ4_NL / MXFP4 (no tail)
        K2 = K2 if (K2 // 32) % 2 == 0 else K2 + 32
        w = random_blocks(name, 8 * K2 // block, rng).reshape(8, -1)
        x2 = rng.normal(0, 1, (1, K2)).astype(np.float32)
        for repack in (False, True) if name in REPACKED else (False,):
            case = f"mm_{name}_K{K2}{'_repacked' if repack else ''}_T1"
            fx.add(case, w, type_id, x2, 1, g.matmul(w, type_id, K2, x2, repack))
            cases.append(case)
    fx.arrays["cases"] = np.array(cases)
    path = ROOT / "tests" / "data" / "iq4.npz"
    np.savez_compressed(path, **fx.arrays)
    print(f"{path}: {len(cases)} matmul cases, {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
