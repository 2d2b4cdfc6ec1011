#!/usr/bin/env python3
"""edge (and llama.cpp) speed while other processes keep cores busy: a table of tokens/s by
load x variant.

    python tools/bench_contention.py --out FILE.jsonl [--models gemma-3-270m,...] [--loads 0,1,2]
        [--variants adaptive,fixed,t1] [--llama-python PATH] [--run-tokens 128] [--table]
        [-- EDGE BENCH OPTIONS, default: -p 128 -n 64 -r 3 -B 4]

For each load (the number of busy-loop processes, ``python -c "while True: pass"``, that this
script starts and kills itself) and each model, it runs one ``edge bench --json`` process per
variant, and with --run-tokens one ``edge run`` (greedy, the default prompt) whose stderr
figure "generated: ... tokens/s" is what a user sees. Variants:

- ``adaptive``: edge as it starts by default (EDGE_ADAPTIVE_THREADS unset);
- ``fixed``: EDGE_ADAPTIVE_THREADS=0, the thread count stays -t (edge before the policy);
- ``t1``: ``-t 1``.

llama.cpp runs once per load and model, in the bench process of the --llama-with variant
(``--vs-llama-cpp``, same thread count as edge's -t; default: the adaptive one, whose bench
starts at the full count), when --llama-python is given. Each result is appended to --out as one JSON line; --table
prints the markdown table of the file instead of measuring.

Before each measurement (before it starts its busy loops) the script waits until other
processes use less than 0.3 of a core over 3 s (/proc/stat, nothing of ours running), at most
--idle-wait seconds, and records that figure (``foreign_cores``) either way: on a shared
machine a number is only as clean as that figure says. ``foreign_during`` is the same figure
over the measurement itself (all busy CPU time minus that of this script's children): a row
whose figure is well above 0 was measured beside someone else's work.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a Python function that reverses a string."
BUSY = "while True: pass"


def busy_seconds() -> tuple[float, float, float]:
    """(clock, CPU seconds all CPUs spent busy since boot (user + nice + system + irq + softirq
    + steal, /proc/stat), CPU seconds of this script's waited-for children)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (time.monotonic(), (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK"),
            kids.ru_utime + kids.ru_stime)


def foreign_cores(before, after) -> float:
    """Cores used by processes other than this script and its children between two busy_seconds()."""
    return ((after[1] - before[1]) - (after[2] - before[2])) / (after[0] - before[0])


def busy_cores(seconds: float) -> float:
    """Cores used by other processes over the next ``seconds`` (nothing of ours runs meanwhile)."""
    before = busy_seconds()
    time.sleep(seconds)
    return foreign_cores(before, busy_seconds())


def wait_idle(max_wait: float, log) -> float:
    """Wait until other processes use < 0.3 core over 3 s (or max_wait passed); returns the last figure."""
    deadline = time.monotonic() + max_wait
    while True:
        c = busy_cores(3.0)
        if c < 0.3 or time.monotonic() > deadline:
            return c
        log(f"  machine busy ({c:.2f} cores used by others), waiting")
        time.sleep(10)


def variant_env(variant: str) -> tuple[dict, list[str]]:
    env = dict(os.environ)
    env.pop("EDGE_ADAPTIVE_THREADS", None)
    if variant == "fixed":
        env["EDGE_ADAPTIVE_THREADS"] = "0"
    return env, (["-t", "1"] if variant == "t1" else [])


def edge_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "edge.cli", *args]


def run_bench(model: str, variant: str, bench_args: list[str], llama: str | None) -> dict:
    env, extra = variant_env(variant)
    cmd = edge_cmd("bench", "-m", model, "--json", *bench_args, *extra)
    if llama:
        cmd += ["--vs-llama-cpp", "--llama-python", llama]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if p.returncode:
        return {"error": p.stderr[-500:]}
    r = json.loads(p.stdout)
    out = {}
    for t in r["tests"]:
        out[t["test"]] = t["edge"]["tps"]
        if t.get("llama_cpp"):
            out["llama.cpp " + t["test"]] = t["llama_cpp"]["tps"]
    return out


def run_run(model: str, variant: str, n: int) -> dict:
    env, extra = variant_env(variant)
    cmd = edge_cmd("run", "-m", model, "-n", str(n), "--temp", "0", *extra, PROMPT)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    m = re.search(r"generated: (\d+) tokens, ([\d.]+) tokens/s", p.stderr)
    if not m:
        return {"error": p.stderr[-500:]}
    return {"run tok/s": float(m.group(2)), "run tokens": int(m.group(1))}


def measure(args, bench_args, log) -> None:
    for load in args.loads:
        for model in args.models:
            for variant in args.variants:
                foreign = wait_idle(args.idle_wait, log)
                before = busy_seconds()
                procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(load)]
                try:
                    time.sleep(1.0 if load else 0.0)
                    t0 = time.time()
                    llama = args.llama_python if variant == args.llama_with else None
                    res = run_bench(model, variant, bench_args, llama)
                    if args.run_tokens:
                        res.update(run_run(model, variant, args.run_tokens))
                finally:
                    for p in procs:
                        p.kill()
                        p.wait()
                during = foreign_cores(before, busy_seconds())
                row = {"load": load, "model": model, "variant": variant, "foreign_cores": foreign,
                       "foreign_during": during,
                       "loadavg": os.getloadavg()[0], "time": t0, "bench_args": bench_args, "results": res}
                log(json.dumps(row))
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


def table(path: str, foreign_limit: float = 0.2) -> str:
    """A markdown table (one row a model, load and test; one column a variant) of the JSON lines.

    Several measurements of one cell are listed in order; one taken while other processes used
    more than ``foreign_limit`` cores (foreign_during) is marked with an asterisk."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    cells: dict = {}
    variants: list[str] = []
    for r in rows:
        mark = "*" if (r.get("foreign_during") or 0) > foreign_limit else ""
        for test, tps in r["results"].items():
            if not isinstance(tps, float):
                continue
            v = r["variant"]
            if test.startswith("llama.cpp "):
                v, test = "llama.cpp", test[len("llama.cpp "):]
            if v not in variants:
                variants.append(v)
            cells.setdefault((r["model"], r["load"], test), {}).setdefault(v, []).append(f"{tps:.1f}{mark}")
    lines = ["| model | busy processes | test | " + " | ".join(variants) + " |",
             "|---|---:|---|" + "---:|" * len(variants)]
    for (model, load, test), by in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        lines.append(f"| {model} | {load} | {test} | " + " | ".join(" / ".join(by.get(v, [])) for v in variants) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="gemma-3-270m,qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--loads", default="0,1,2")
    ap.add_argument("--variants", default="adaptive,fixed,t1")
    ap.add_argument("--llama-python", default=None)
    ap.add_argument("--llama-with", default="adaptive", help="the variant whose bench process also runs llama.cpp")
    ap.add_argument("--run-tokens", type=int, default=0)
    ap.add_argument("--idle-wait", type=float, default=120.0)
    ap.add_argument("--table", action="store_true")
    ap.add_argument("bench", nargs="*")
    args = ap.parse_args()
    if args.table:
        print(table(args.out))
        return 0
    args.models = args.models.split(",")
    args.loads = [int(x) for x in args.loads.split(",")]
    args.variants = args.variants.split(",")
    bench_args = args.bench or ["-p", "128", "-n", "64", "-r", "3", "-B", "4"]
    measure(args, bench_args, lambda m: print(m, file=sys.stderr, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
