#!/usr/bin/env python3
"""Generated tokens/s of `edge run -n N` beside llama.cpp (llama-cpp-python) on the same machine.

    python tools/speed_vs_llama_cpp.py [--models a,b,c] [-n 128] [-t 2] [--llama-python PATH]

edge is timed through its CLI (its own stats line on stderr); llama.cpp through
llama-cpp-python in a separate interpreter (``--llama-python``, default: this one). Both run
the same raw prompt greedily with the same thread count; tokens/s counts the tokens after the
first (whose time is the TTFT), and the best of ``--reps`` runs is kept. Prints a markdown table. Needs llama-cpp-python for the
llama.cpp column (it is an optional extra; building it from source takes minutes).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

PROMPT = "Write a Python function that reverses a string."
MODELS = ["qwen2.5-coder-0.5b-instruct", "gemma-3-270m", "qwen2.5-coder-1.5b-instruct"]

_LLAMA_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
path, n, threads, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
llm = Llama(path, n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)
gen = 0
t0 = time.perf_counter(); t_first = None
for out in llm.create_completion(prompt, max_tokens=n, temperature=0.0, stream=True):
    now = time.perf_counter()
    if t_first is None:
        t_first = now
    gen += 1
t_end = time.perf_counter()
print(json.dumps({"ttft": t_first - t0, "gen": gen, "tps": (gen - 1) / (t_end - t_first) if gen > 1 else 0.0}))
"""


def edge_run(model: str, n: int, threads: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "edge.cli", "run", "-m", model, "-n", str(n), "-t", str(threads),
                           "--temp", "0", "--raw", PROMPT], capture_output=True, text=True, check=True)
    m = re.search(r"prompt: (\d+) tokens, TTFT (\d+) ms, ([0-9.]+) tokens/s \| generated: (\d+) tokens, ([0-9.]+) tokens/s",
                  proc.stderr)
    return {"ttft": int(m.group(2)) / 1000, "gen": int(m.group(4)), "tps": float(m.group(5))}


def llama_run(python: str, path: str, n: int, threads: int) -> dict | None:
    proc = subprocess.run([python, "-c", _LLAMA_SCRIPT, path, str(n), str(threads), PROMPT],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"llama.cpp run failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    from edge.store import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--llama-python", default=sys.executable)
    ap.add_argument("--reps", type=int, default=3, help="runs per engine and model; the best is kept")
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        path = str(resolve_model(name))
        e = max((edge_run(name, args.n, args.threads) for _ in range(args.reps)), key=lambda r: r["tps"])
        ls = [r for r in (llama_run(args.llama_python, path, args.n, args.threads) for _ in range(args.reps)) if r]
        lc = max(ls, key=lambda r: r["tps"]) if ls else None
        rows.append((name, e, lc))
    print(f"| model | edge tg{args.n} t/s | llama.cpp tg{args.n} t/s | edge / llama.cpp |")
    print("|---|---|---|---|")
    for name, e, lc in rows:
        ratio = f"{e['tps'] / lc['tps']:.2f}" if lc else "n/a"
        print(f"| {name} | {e['tps']:.1f} | {lc['tps']:.1f} | {ratio} |" if lc else f"| {name} | {e['tps']:.1f} | n/a | n/a |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
