"""Write tests/data/iq1tq.npz: ggml's own IQ1_S / IQ1_M / TQ1_0 / TQ2_0 dequantization and
matmul results, for tests/test_iq1tq.py to hold kernels_cpu.iq1tq to them bit for bit.

Run with the oracle interpreter (llama-cpp-python built from source on this AVX2 machine) from
the repository root:

    ~/.cache/edge-oracle/llama-cpp-python-0.3.36/venv/bin/python tools/make_iq1tq_fixtures.py

Per type NAME, weights NAME_w uint8[R, row_bytes] (R = 8, K = 512: random bytes with realistic
f16 scales, plus rows with an all-zero block, tiny (subnormal f16) and huge (f16 max) scales,
negative scales) and activations x float32[11, 512] shared by all types:
* NAME_deq float32[R, K]: ggml_get_type_traits(type)->to_float of each row;
* NAME_vecdot float32[T, R]: ggml_get_type_traits_cpu(type)->vec_dot of each weight row with
  from_float(x[t]) (Q8_K), T = 11;
* NAME_mm<T>_<R> float32[T, R]: ggml_mul_mat through a graph (2 threads, plain CPU buffer) for
  T in MM_T and R in (6, 8) (the first R weight rows, the first T rows of x);
* NAME_big_w uint8[16, row_bytes] (K = 2560: 10 blocks), x_big float32[9, 2560], NAME_big<T>
  float32[T, 16] for T in (1, 9): ggml_mul_mat over a longer row.
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_matmul_fixtures import GgmlMatmul

ROOT = Path(__file__).resolve().parents[1]
QK_K, K, R, T_MAX = 256, 512, 8, 11
MM_T = (1, 2, 5, 8, 11)
K_BIG, R_BIG = 2560, 16
# name -> (ggml type id, bytes per block, byte offset of the f16 scale, or None for IQ1_M)
TYPES = {"IQ1_S": (19, 50, 0), "IQ1_M": (29, 56, None), "TQ1_0": (34, 54, 52), "TQ2_0": (35, 66, 64)}
Q8_K_BYTES = 4 + QK_K + 2 * QK_K // 16
F16_MAX, F16_TINY, F16_MIN_NORMAL = 0x7BFF, 0x0001, 0x0400


class _Traits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


class _TraitsCpu(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                           ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def set_scale(block: np.ndarray, off, bits: int) -> None:
    """Store f16 bits as the block's scale (IQ1_M: spread over the top nibbles of scales[0..3])."""
    if off is None:
        sc = block[48:56].view(np.uint16)
        for i in range(4):
            sc[i] = (sc[i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
    else:
        block[off:off + 2].view(np.uint16)[0] = bits


def weights(name: str, rng, n_rows: int = R, k: int = K) -> np.ndarray:
    """uint8[n_rows, row_bytes]: random blocks, realistic scales; special blocks in rows 5..7."""
    _, nbytes, off = TYPES[name]
    w = rng.integers(0, 256, (n_rows, k // QK_K, nbytes), dtype=np.uint8)
    for r in range(n_rows):
        for b in range(k // QK_K):
            d = np.float16(rng.choice((-1, 1)) * 10 ** rng.uniform(-3, -1.3)).view(np.uint16)
            set_scale(w[r, b], off, int(d))
    w[5, 0] = 0  # all-zero block
    set_scale(w[5, 1], off, F16_TINY)
    set_scale(w[6, 0], off, F16_MAX)
    set_scale(w[6, 1], off, 0x8000 | F16_MIN_NORMAL)  # -smallest normal
    set_scale(w[7, 0], off, 0x8000 | F16_MAX)
    set_scale(w[7, 1], off, 0x03FF)  # largest subnormal
    return w.reshape(n_rows, -1)


def main() -> None:
    g = GgmlMatmul()
    g.base.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
    g.base.ggml_get_type_traits.argtypes = [ctypes.c_int]
    g.cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TraitsCpu)
    g.cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    rng = np.random.default_rng(17)
    x = rng.standard_normal((T_MAX, K)).astype(np.float32)
    x[3, 256:] = 0.0  # an all-zero activation block
    x[4] *= 50.0
    x_big = rng.standard_normal((9, K_BIG)).astype(np.float32)
    data = {"x": x, "x_big": x_big}
    for name, (tid, _, _) in TYPES.items():
        w = weights(name, rng)
        tr, tc = g.base.ggml_get_type_traits(tid).contents, g.cpu.ggml_get_type_traits_cpu(tid).contents
        assert tc.vec_dot_type == 15, (name, tc.vec_dot_type)  # Q8_K
        deq = np.empty((R, K), np.float32)
        for r in range(R):
            TO_FLOAT(tr.to_float)(w[r].ctypes.data, deq[r].ctypes.data, K)
        from_float = TO_FLOAT(g.cpu.ggml_get_type_traits_cpu(15).contents.from_float)  # quantize_row_q8_K
        vec_dot = VEC_DOT(tc.vec_dot)
        xq = np.empty((T_MAX, K // QK_K * Q8_K_BYTES), np.uint8)
        vd = np.empty((T_MAX, R), np.float32)
        for t in range(T_MAX):
            from_float(x[t].ctypes.data, xq[t].ctypes.data, K)
            for r in range(R):
                s = ctypes.c_float()
                vec_dot(K, ctypes.addressof(s), 0, w[r].ctypes.data, 0, xq[t].ctypes.data, 0, 1)
                vd[t, r] = s.value
        data.update({f"{name}_w": w, f"{name}_deq": deq, f"{name}_vecdot": vd})
        for T in MM_T:
            for rows in (6, 8):
                xt = np.ascontiguousarray(x[:T])
                data[f"{name}_mm{T}_{rows}"] = g.matmul(np.ascontiguousarray(w[:rows]), tid, K, xt, False)
        w_big = weights(name, rng, R_BIG, K_BIG)
        data[f"{name}_big_w"] = w_big
        for T in (1, 9):
            data[f"{name}_big{T}"] = g.matmul(w_big, tid, K_BIG, np.ascontiguousarray(x_big[:T]), False)
    out = ROOT / "tests" / "data" / "iq1tq.npz"
    np.savez_compressed(out, **data)
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
