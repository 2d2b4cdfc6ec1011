"""Cost of one forward step of k rows against a step of one row (issue 18's "a (k+1)-row step
with k = 4 costs <= 1.3x a one-row step"; speculative decoding verifies k drafted tokens and
the next one in one step).

    python tools/bench_step.py [-m MODEL] [-k 1,2,3,4,5,8] [--ctx 256] [-r 15] [--llama-cpp-kernels]

Each step appends k tokens to one sequence that already holds ``--ctx`` tokens (rows of one
sequence, as a verification step; ``--sequences`` makes them k sequences of one row each, a
batched decode step) and is timed as one Transformer.forward; the KV cache is rolled back
between steps, so every step sees the same context. Batch-invariant kernels (edge serve's, the
mode speculative decoding needs to give the tokens plain decoding gives) unless
``--llama-cpp-kernels``. Prints the median step time per k and its ratio to k = 1.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="model name or .gguf path (default: the default model)")
    ap.add_argument("-k", "--rows", default="1,2,3,4,5,8", help="rows per step, comma-separated (default 1,2,3,4,5,8)")
    ap.add_argument("--ctx", type=int, default=256, help="tokens already in each sequence (default 256)")
    ap.add_argument("-r", "--reps", type=int, default=15, help="timed steps per k (default 15)")
    ap.add_argument("--sequences", action="store_true", help="k sequences of one row each (batched decode)")
    ap.add_argument("--llama-cpp-kernels", action="store_true", help="llama.cpp's kernel choice per batch size")
    args = ap.parse_args()

    from edge.engine import Engine
    from edge.kv.cache import PagedKVCache
    from edge.store import resolve_model

    ks = [int(k) for k in args.rows.split(",")]
    engine = Engine(resolve_model(args.model), n_ctx=args.ctx + max(ks) + 16,
                    batch_invariant=not args.llama_cpp_kernels)
    model = engine.model
    rng = np.random.default_rng(0)
    n_seq = max(ks) if args.sequences else 1
    kv = PagedKVCache(model.args, engine.n_ctx, n_seq, engine.block_size, storage="anon")
    slots = []
    for _ in range(n_seq):
        ids = [int(i) for i in rng.integers(100, 20000, args.ctx)]
        slot, _ = kv.new_sequence(ids, lookahead=max(ks))
        engine.prefill(ids, kv, seq=slot)
        slots.append(slot)

    def step(k: int) -> float:
        toks = [int(t) for t in rng.integers(100, 20000, k)]
        seqs = slots[:k] if args.sequences else [slots[0]] * k
        for s, t in zip(seqs, toks):
            kv.append(s, [t])
        t0 = time.perf_counter()
        model.forward(toks, kv, seq_ids=seqs)
        dt = time.perf_counter() - t0
        for s in set(seqs):
            kv.truncate(s, args.ctx)
        return dt

    times = {}
    for k in ks:
        for _ in range(3):
            step(k)
        times[k] = statistics.median(step(k) for _ in range(args.reps))
    base = times.get(1) or times[ks[0]]
    what = "sequences of one row" if args.sequences else "rows of one sequence"
    mode = "llama.cpp's kernels" if args.llama_cpp_kernels else "batch-invariant"
    print(f"{engine.name}: step of k {what}, {args.ctx} tokens of context, {mode}, median of {args.reps}")
    for k in ks:
        print(f"  k={k}: {times[k] * 1e3:7.2f} ms  {times[k] / base:5.2f}x the one-row step")
    kv.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
