#!/usr/bin/env python3
"""Attention kernel timing (kernels_cpu.attention.paged_attention) on random f16 KV pools: one
layer's causal attention for T query rows at the end of a context of C tokens in one sequence.

    python tools/bench_attention.py [-T 512] [-H 14] [--kv-heads 2] [--head-dim 64] [-c CONTEXT]
                                    [-s SEQS] [-t THREADS] [-r REPEATS] [--block-size 16] [--kv f16]
                                    [--pairs]

With -s S, S sequences of C tokens each, the batch holding the last T positions of each (-T 1
-s 8: a step of 8 sequences decoding together). Prints, for both lane orders (llama.cpp's batch orders, tinyBLAS, and the batch-invariant ones,
ggml_vec_dot_f16), the median milliseconds per layer over the repeats and the GFLOP/s of the
two products (2 * H * visible cells * (head_dim + head_dim_v) flops), and the median CPU time
of the process per call (with one thread, the better figure while other processes share the
cores; with more, idle worker threads may add their spinning).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-T", type=int, default=512, help="query rows (the last T positions of the context)")
    ap.add_argument("-H", type=int, default=14, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=2, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--head-dim-v", type=int, default=0, help="V head size (default: head_dim)")
    ap.add_argument("-c", "--context", type=int, default=0, help="context length (default: T)")
    ap.add_argument("-s", "--seqs", type=int, default=1, help="sequences, T rows each")
    ap.add_argument("-w", "--window", type=int, default=0, help="sliding window (0: none)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--repeats", type=int, default=9)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv", choices=["f16", "f32", "q8_0"], default="f16", help="KV pool type")
    ap.add_argument("--pairs", action="store_true",
                    help="time the walk of one (row, head) pair at a time instead (the path before the tiles)")
    args = ap.parse_args()

    import numba
    from kernels_cpu import attention
    from kernels_cpu.attention import paged_attention, store_kv

    numba.set_num_threads(args.threads)
    T, H, H_kv, hd = args.T, args.H, args.kv_heads, args.head_dim
    hd_v = args.head_dim_v or hd
    C = max(args.context, T)
    S = args.seqs
    bs = args.block_size
    rng = np.random.default_rng(0)
    n_blocks = -(-C // bs)
    row = {"f16": (np.uint16, 1), "f32": (np.float32, 1), "q8_0": (np.uint8, 34 / 32)}[args.kv]
    k_pool = np.zeros((S * n_blocks + 1, bs, H_kv, int(hd * row[1])), row[0])
    v_pool = np.zeros((S * n_blocks + 1, bs, H_kv, int(hd_v * row[1])), row[0])
    tables = rng.permutation(S * n_blocks + 1).astype(np.int32)[: S * n_blocks].reshape(S, n_blocks)
    all_pos = np.tile(np.arange(C, dtype=np.int32), S)
    all_seq = np.repeat(np.arange(S, dtype=np.int32), C)
    store_kv(rng.standard_normal((S * C, H_kv * hd)).astype(np.float32), k_pool, tables, all_seq, all_pos)
    store_kv(rng.standard_normal((S * C, H_kv * hd_v)).astype(np.float32), v_pool, tables, all_seq, all_pos)
    positions = np.tile(np.arange(C - T, C, dtype=np.int32), S)
    seq_ids = np.repeat(np.arange(S, dtype=np.int32), T)
    q = rng.standard_normal((S * T, H, hd)).astype(np.float32)
    out = np.empty((S * T, H, hd_v), np.float32)
    scale = np.float32(1 / np.sqrt(hd))
    cells = sum(min(p + 1, args.window) if args.window else p + 1 for p in positions)
    flops = 2.0 * H * cells * (hd + hd_v)
    print(f"T={T} x {S} seqs H={H} H_kv={H_kv} hd={hd} hd_v={hd_v} context={C} window={args.window} "
          f"threads={args.threads} kv={args.kv} block={bs}" + (" (pairs)" if args.pairs else ""))

    def pairs(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, out, batch_invariant):
        # paged_attention before the tiles: serial below PARALLEL_MIN_MACS
        tiny_kq, tiny_kqv = attention._paths(len(q), hd, hd_v, batch_invariant)
        if len(q) * H * (cells // len(q)) * hd >= attention.PARALLEL_MIN_MACS:
            attention._attention_par(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, np.float32(0),
                                     out, tiny_kq, tiny_kqv)
        else:
            attention._attention_rows(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, np.float32(0),
                                      out, 0, 1, tiny_kq, tiny_kqv)

    run = pairs if args.pairs else paged_attention
    for batch_invariant in (False, True):
        times, cpu = [], []
        for _ in range(args.repeats + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            run(q, k_pool, v_pool, tables, seq_ids, positions, args.window, scale, out, batch_invariant)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        ms = statistics.median(times[1:]) * 1e3       # the first call may compile
        name = "batch-invariant (vec_dot_f16)" if batch_invariant else "batch (tinyBLAS)"
        print(f"  {name:30s} {ms:8.3f} ms/layer  {flops / ms / 1e6:7.1f} GFLOP/s  "
              f"(min {min(times[1:]) * 1e3:.2f}; CPU time {statistics.median(cpu[1:]) * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
