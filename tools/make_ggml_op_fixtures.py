"""Regenerate tests/data/ggml_ops.npz: ggml's CPU results for element-wise ops on synthetic
inputs, covering cases the real models do not reach (NORM RoPE with llama-3 frequency factors
and linear scaling, partial rotary dimensions, large positions, SwiGLU rows whose length is not
a multiple of 16, GeGLU around its +-10 cut-offs).

Runs the ops through ggml's own graph API (ggml_init, ggml_rope_ext, ggml_swiglu_split,
ggml_geglu_split, ggml_graph_compute_with_ctx) from the libraries of a llama-cpp-python built
from source on an AVX-512 x86 machine, the build that made the goldens:

    /path/to/llama-venv/bin/python tools/make_ggml_op_fixtures.py
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_dump import _Tensor  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GGML_TYPE_F32, GGML_TYPE_I32 = 0, 26
GGML_ROPE_TYPE_NORMAL, GGML_ROPE_TYPE_NEOX = 0, 2


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class Ggml:
    """A ggml context over the llama_cpp package's libggml-base / libggml-cpu."""

    def __init__(self, mem_mb: int = 256):
        import llama_cpp

        libdir = Path(llama_cpp.__file__).parent / "lib"
        self.base = ctypes.CDLL(str(libdir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(libdir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        vp, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        self.base.ggml_init.restype = vp
        self.base.ggml_init.argtypes = [_InitParams]
        for name, args in (("ggml_new_tensor_1d", [vp, i32, i64]), ("ggml_new_tensor_2d", [vp, i32, i64, i64]),
                           ("ggml_new_tensor_3d", [vp, i32, i64, i64, i64]),
                           ("ggml_rope_ext", [vp, vp, vp, vp, i32, i32, i32] + [f32] * 6),
                           ("ggml_swiglu_split", [vp, vp, vp]), ("ggml_geglu_split", [vp, vp, vp]),
                           ("ggml_new_graph", [vp])):
            fn = getattr(self.base, name)
            fn.restype, fn.argtypes = vp, args
        self.base.ggml_build_forward_expand.argtypes = [vp, vp]
        self.cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, i32]
        self.ctx = self.base.ggml_init(_InitParams(mem_mb << 20, None, False))

    def tensor(self, a: np.ndarray) -> int:
        """A new ggml tensor holding a (numpy order: ggml ne reversed)."""
        typ = GGML_TYPE_I32 if a.dtype == np.int32 else GGML_TYPE_F32
        ne = a.shape[::-1]
        t = getattr(self.base, f"ggml_new_tensor_{len(ne)}d")(self.ctx, typ, *ne)
        ctypes.memmove(_Tensor.from_address(t).data, np.ascontiguousarray(a).ctypes.data, a.nbytes)
        return t

    def compute(self, t: int, shape) -> np.ndarray:
        gf = self.base.ggml_new_graph(self.ctx)
        self.base.ggml_build_forward_expand(gf, t)
        self.cpu.ggml_graph_compute_with_ctx(self.ctx, gf, 2)
        n = int(np.prod(shape))
        return np.ctypeslib.as_array((ctypes.c_float * n).from_address(_Tensor.from_address(t).data)).reshape(shape).copy()


def main() -> None:
    g = Ggml()
    rng = np.random.default_rng(7)
    out: dict[str, np.ndarray] = {}
    rope_cases = {  # name: (mode, hd, n_rot, base, freq_scale, with freq_factors)
        "rope_norm_factors": (GGML_ROPE_TYPE_NORMAL, 64, 64, 500000.0, 0.25, True),
        "rope_norm": (GGML_ROPE_TYPE_NORMAL, 48, 48, 10000.0, 1.0, False),
        "rope_neox_partial": (GGML_ROPE_TYPE_NEOX, 64, 32, 1000000.0, 1.0, False),
    }
    pos = np.array([0, 1, 7, 100, 511, 4095, 30000], np.int32)
    for name, (mode, hd, n_rot, base, scale, with_ff) in rope_cases.items():
        x = (rng.standard_normal((len(pos), 3, hd)) * 4).astype(np.float32)
        ff = rng.uniform(1.0, 8.0, n_rot // 2).astype(np.float32) if with_ff else None
        t = g.base.ggml_rope_ext(g.ctx, g.tensor(x), g.tensor(pos), g.tensor(ff) if with_ff else None,
                                 n_rot, mode, 0, base, scale, 0.0, 1.0, 32.0, 1.0)
        out[f"{name}_x"], out[f"{name}_pos"], out[f"{name}_out"] = x, pos, g.compute(t, x.shape)
        out[f"{name}_params"] = np.array([mode, n_rot, base, scale], np.float64)
        if with_ff:
            out[f"{name}_ff"] = ff
    gate = (rng.standard_normal((3, 1000)) * 6).astype(np.float32)  # 1000 = 62 * 16 + 8
    gate[0, :40] = [-10.0, 10.0, -9.999999, 9.999999, -10.000001, 10.000001, 0.0, -0.0] * 5
    up = rng.standard_normal((3, 1000)).astype(np.float32)
    out["glu_gate"], out["glu_up"] = gate, up
    out["swiglu_out"] = g.compute(g.base.ggml_swiglu_split(g.ctx, g.tensor(gate), g.tensor(up)), gate.shape)
    out["geglu_out"] = g.compute(g.base.ggml_geglu_split(g.ctx, g.tensor(gate), g.tensor(up)), gate.shape)
    dest = ROOT / "tests" / "data" / "ggml_ops.npz"
    np.savez_compressed(dest, **out)
    print(f"{dest}: {len(out)} arrays, {dest.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
