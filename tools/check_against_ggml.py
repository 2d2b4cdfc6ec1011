#!/usr/bin/env python3
"""Differential check of edge's kernels against a llama.cpp build's own ggml-cpu library.

Loads libggml-base.so and libggml-cpu.so from LIB_DIR (e.g. the ``lib`` folder of a
llama-cpp-python install) through ctypes and compares, on random activations (with outliers
and exact rounding ties) and on random or real (--model) weights:

* quantize_row_q8_0 / q8_1 / q8_K against kernels_cpu.quantize_act: must be bit-identical;
* ggml_vec_dot_<type>_<vec_dot_type> against kernels_cpu.matmul: must agree up to float
  summation order (relative differences around 1e-7).

Not a test (it needs a library outside the project). Usage:
    python tools/check_against_ggml.py LIB_DIR [--model FILE.gguf]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys

import numpy as np

VP = ctypes.c_void_p
ACT = {"q8_0": (32, 34), "q8_1": (32, 36), "q8_K": (256, 292)}  # values and bytes per block


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(VP)


def load_ggml(lib_dir: str):
    ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(os.path.join(lib_dir, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    cpu.ggml_cpu_init()
    for act in ACT:
        getattr(cpu, f"quantize_row_{act}").argtypes = [VP, VP, ctypes.c_int64]
    return cpu


def ggml_quantize(cpu, act: str, x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_<act> of float32[K] -> uint8[K / block, block bytes]."""
    block, size = ACT[act]
    buf = np.zeros((x.size // block, size), np.uint8)
    getattr(cpu, f"quantize_row_{act}")(_ptr(x), _ptr(buf), x.size)
    return buf


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16)[:, 0].astype(np.float32)


def check_quantize(cpu, xs) -> int:
    """Number of values (quants, scales, sums) where edge and ggml differ."""
    from kernels_cpu import quantize_act as qa

    bad = 0
    for x in xs:
        b = ggml_quantize(cpu, "q8_0", x)
        q, d = qa.quantize_q8_0(x[None])
        bad += (q[0] != b[:, 2:].view(np.int8).reshape(-1)).sum() + (d[0] != _f16(b[:, :2])).sum()
        b = ggml_quantize(cpu, "q8_1", x)
        q, d, s = qa.quantize_q8_1(x[None])
        bad += (q[0] != b[:, 4:].view(np.int8).reshape(-1)).sum() + (d[0] != _f16(b[:, :2])).sum()
        bad += (s[0] != _f16(b[:, 2:4])).sum()
        b = ggml_quantize(cpu, "q8_K", x)
        q, d, bsums = qa.quantize_q8_k(x[None])
        bad += (q[0] != b[:, 4:260].view(np.int8).reshape(-1)).sum()
        bad += (d[0] != b[:, :4].copy().view(np.float32)[:, 0]).sum()
        bad += (bsums[0] != b[:, 260:].copy().view(np.int16).reshape(-1)).sum()
    return int(bad)


def check_dot(cpu, w: np.ndarray, t, xs) -> float:
    """max |edge - ggml| / max |ggml| over the rows of w and the activations xs."""
    from kernels_cpu.matmul import FORMATS, matmul

    act = {"q8_0": "q8_0", "q8_1": "q8_1", "q8_k": "q8_K"}[FORMATS[t].act]
    fn = getattr(cpu, f"ggml_vec_dot_{t.name.lower().replace('_k', '_K')}_{act}")
    fn.argtypes = [ctypes.c_int, VP, ctypes.c_size_t, VP, ctypes.c_size_t, VP, ctypes.c_size_t, ctypes.c_int]
    worst, s = 0.0, ctypes.c_float()
    for x in xs:
        buf = ggml_quantize(cpu, act, x)
        mine = matmul(w, t, x[None])[0]
        ref = np.empty(w.shape[0], np.float32)
        for r in range(w.shape[0]):
            fn(x.size, ctypes.byref(s), 0, _ptr(w[r]), 0, _ptr(buf), 0, 1)
            ref[r] = s.value
        worst = max(worst, float(np.abs(mine - ref).max() / np.abs(ref).max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("lib_dir", help="folder holding libggml-base.so and libggml-cpu.so")
    parser.add_argument("--model", help="also check the 2-D quantized tensors of this GGUF (first 64 rows)")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from kernels_cpu.matmul import FORMATS
    from tests.test_matmul import random_weights

    cpu = load_ggml(args.lib_dir)
    rng = np.random.default_rng(0)
    K = 4864
    xs = [rng.normal(0, 1, K).astype(np.float32) for _ in range(40)]
    xs[3][::7] *= 100  # outliers
    xs.append(np.round(rng.normal(0, 30, K)).astype(np.float32) + np.float32(0.5))  # rounding ties
    print(f"activation quantization (Q8_0, Q8_1, Q8_K; {len(xs)} rows of {K}): "
          f"{check_quantize(cpu, xs)} values differ from ggml")
    for t in FORMATS:
        print(f"{t.name:5s} random weights: max rel. difference {check_dot(cpu, random_weights(t, 64, K, rng), t, xs[:8]):.1e}")
    if args.model:
        from edge.gguf_file import GGUFFile

        gf = GGUFFile(args.model)
        seen = set()
        for name, info in gf.tensors.items():
            if len(info.shape) == 2 and info.ggml_type in FORMATS and (info.ggml_type, info.shape[0]) not in seen:
                seen.add((info.ggml_type, info.shape[0]))
                xr = [rng.normal(0, 1, info.shape[0]).astype(np.float32) for _ in range(4)]
                w = np.ascontiguousarray(gf.tensor_rows(name)[:64])
                print(f"{info.ggml_type.name:5s} {name}: max rel. difference {check_dot(cpu, w, info.ggml_type, xr):.1e}")


if __name__ == "__main__":
    main()
