#!/usr/bin/env python3
"""Benchmark edge's quantized matmul kernels (not a test: numbers depend on the machine and load).

* decode (T = 1): effective weight bandwidth, GB/s = weight bytes / time. Each timed pass cycles
  through enough copies of the weight matrix (>= --working-set MB) that they come from DRAM,
  as in real decode, not from the caches.
* batched decode and prefill (T = 8, 64, 512): GFLOP/s = 2 * R * K * T / time.
* compile: first call of each type in a fresh process with an empty numba cache, then again
  with the warm cache (--compile).

Run with NUMBA_NUM_THREADS set (e.g. 2); the script prints the thread count it used.
* model (--model FILE): one decode step's matmuls over all 2-D weights of a GGUF model.

Usage: python tools/bench_kernels.py [--types Q5_0,Q8_0,Q4_K,Q6_K] [--shapes 0.5b|1.5b] [--compile] [--quick]
       [--model F]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from gguf import GGMLQuantizationType

from kernels_cpu.ggml_types import TYPES

SHAPES = {  # model -> (decode (R, K), prefill (R, K, T)): attn_q, ffn_up, ffn_down, output
    "0.5b": ([(896, 896), (4864, 896), (896, 4864), (151936, 896)],
             [(4864, 896, 8), (896, 4864, 8), (4864, 896, 64), (896, 4864, 64), (4864, 896, 512), (896, 4864, 512)]),
    "1.5b": ([(1536, 1536), (8960, 1536), (1536, 8960), (151936, 1536)],
             [(8960, 1536, 8), (1536, 8960, 8), (8960, 1536, 64), (1536, 8960, 64), (8960, 1536, 512),
              (1536, 8960, 512)]),
}
ALL_TYPES = ",".join(t.name for t in TYPES)


def random_rows(t, R: int, K: int, rng) -> np.ndarray:
    """uint8[R, row_bytes] of random blocks whose f16 scales are small finite numbers."""
    block, size = TYPES[t].block_size, TYPES[t].type_size
    raw = rng.integers(0, 256, (R, K // block, size), dtype=np.uint8)
    if block == 1:  # float types: random small values
        return (rng.normal(0, 0.02, (R, K)).astype(np.float32).view(np.uint8) if size == 4 else
                rng.normal(0, 0.02, (R, K)).astype(np.float16).view(np.uint8))
    raw[..., :2] = raw[..., :2] & np.uint8(0x3F)  # keep a leading f16 field finite (exponent < 31)
    raw[..., -2:] = raw[..., -2:] & np.uint8(0x3F)
    if t == GGMLQuantizationType.MXFP4:  # e8m0 exponent byte near 2^0, as in real files (no subnormal products)
        raw[..., 0] = rng.integers(120, 135, raw.shape[:-1], dtype=np.uint8)
    return raw.reshape(R, -1)


def best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_decode(t, R: int, K: int, working_set: float, repeats: int, ws) -> str:
    from kernels_cpu.matmul import matmul

    rng = np.random.default_rng(0)
    first = random_rows(t, R, K, rng)
    copies = [first] + [first.copy() for _ in range(max(0, int(working_set * 1e6 // first.nbytes)))]
    x = rng.normal(0, 1, (1, K)).astype(np.float32)
    out = np.empty((1, R), np.float32)
    matmul(first, t, x, out, ws)

    def run():
        for w in copies:
            matmul(w, t, x, out, ws)

    per_call = best_time(run, repeats) / len(copies)
    return f"{t.name:5s} decode  {R:6d} x {K:4d}: {first.nbytes / per_call / 1e9:6.1f} GB/s  ({per_call * 1e3:7.3f} ms)"


def bench_prefill(t, R: int, K: int, T: int, repeats: int, ws) -> str:
    from kernels_cpu.matmul import matmul

    rng = np.random.default_rng(1)
    w = random_rows(t, R, K, rng)
    x = rng.normal(0, 1, (T, K)).astype(np.float32)
    out = np.empty((T, R), np.float32)
    matmul(w, t, x, out, ws)
    dt = best_time(lambda: matmul(w, t, x, out, ws), repeats)
    return f"{t.name:5s} prefill {R:6d} x {K:4d}, T={T:3d}: {2 * R * K * T / dt / 1e9:6.1f} GFLOP/s ({dt * 1e3:7.2f} ms)"


def bench_model(path: str, repeats: int, ws) -> list[str]:
    """One decode step's matmuls over every 2-D weight of a GGUF model (token_embd excluded:
    it is a row lookup; output/tied embedding included): total time and weight bandwidth."""
    from edge.gguf_file import GGUFFile
    from kernels_cpu.matmul import matmul

    gf = GGUFFile(path)
    names = [n for n, t in gf.tensors.items() if len(t.shape) == 2 and n != "token_embd.weight"]
    if "output.weight" not in gf.tensors:
        names.append("token_embd.weight")  # tied output
    mats = [(gf.tensor_rows(n), gf.tensors[n].ggml_type, gf.tensors[n].shape[0]) for n in names]
    xs = {k: np.random.default_rng(k).normal(0, 1, (1, k)).astype(np.float32) for _, _, k in mats}
    outs = [np.empty((1, w.shape[0]), np.float32) for w, _, _ in mats]

    def step():
        for (w, t, k), out in zip(mats, outs):
            matmul(w, t, xs[k], out, ws)

    step()
    dt = best_time(step, repeats)
    total = sum(w.nbytes for w, _, _ in mats)
    by_type: dict[str, int] = {}
    for w, t, _ in mats:
        by_type[t.name] = by_type.get(t.name, 0) + w.nbytes
    mix = ", ".join(f"{name} {n / 1e6:.0f} MB" for name, n in sorted(by_type.items()))
    return [f"model {os.path.basename(path)}: {len(mats)} matmuls per token ({mix})",
            f"  decode step {dt * 1e3:.2f} ms, {total / dt / 1e9:.1f} GB/s of weights"]


_COMPILE_SNIPPET = """
import sys, time, numpy as np
from gguf import GGMLQuantizationType as T
from kernels_cpu.ggml_types import TYPES
from kernels_cpu.matmul import matmul
for name in sys.argv[1].split(","):
    t = T[name]
    block, size = TYPES[t].block_size, TYPES[t].type_size
    w = np.zeros((8, 256 // block * size), np.uint8)
    t0 = time.perf_counter()
    matmul(w, t, np.ones((1, 256), np.float32))
    t1 = time.perf_counter()
    matmul(w, t, np.ones((9, 256), np.float32))
    print(f"{name} {t1 - t0:.2f} {time.perf_counter() - t0:.2f}", flush=True)
"""


def bench_compile(types: str) -> list[str]:
    """First-call times (decode, then decode + prefill) per type: cold cache, then warm cache."""
    lines = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        for label in ("empty cache", "warm cache"):
            t0 = time.perf_counter()
            res = subprocess.run([sys.executable, "-c", _COMPILE_SNIPPET, types], env=env,
                                 capture_output=True, text=True, check=True)
            total = time.perf_counter() - t0
            lines.append(f"compile, {label} (process total {total:.1f} s incl. imports):")
            for row in res.stdout.split("\n"):
                if row:
                    name, dec, both = row.split()
                    lines.append(f"  {name:5s} first T=1 call {float(dec):5.2f} s, then T=9 call: "
                                 f"{float(both) - float(dec):5.2f} s")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", default="Q5_0,Q8_0,Q4_K,Q6_K", help=f"comma list, or 'all' ({ALL_TYPES})")
    parser.add_argument("--compile", action="store_true", help="also measure compile times")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller working set")
    parser.add_argument("--working-set", type=float, default=512, help="MB of weight copies per decode pass")
    parser.add_argument("--shapes", default="0.5b", choices=sorted(SHAPES), help="qwen2.5 matrix shapes")
    parser.add_argument("--model", action="append", default=[], help="GGUF file: time one decode step's matmuls")
    args = parser.parse_args()

    import numba
    from gguf import GGMLQuantizationType

    from kernels_cpu.matmul import MatmulWorkspace

    names = ALL_TYPES if args.types == "all" else args.types
    types = [GGMLQuantizationType[n.strip().upper()] for n in names.split(",")]
    repeats = 3 if args.quick else 7
    working_set = 64 if args.quick else args.working_set
    print(f"numba threads: {numba.get_num_threads()}", flush=True)
    ws = MatmulWorkspace(512, 8960)
    for path in args.model:
        print("\n".join(bench_model(path, repeats, ws)), flush=True)
    decode_shapes, prefill_shapes = SHAPES[args.shapes]
    for t in types:
        block = TYPES[t].block_size
        for R, K in decode_shapes:
            if K % block == 0:
                print(bench_decode(t, R, K, working_set, repeats, ws), flush=True)
        for R, K, T in prefill_shapes:
            if K % block == 0:
                print(bench_prefill(t, R, K, T, max(2, repeats // 2), ws), flush=True)
    print(f"threading layer: {numba.threading_layer()}")
    if args.compile:
        print("\n".join(bench_compile(names)))


if __name__ == "__main__":
    main()
