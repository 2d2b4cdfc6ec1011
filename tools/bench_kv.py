#!/usr/bin/env python3
"""KV cache measurements (issue 4): prefix caching in a 4-turn chat, session restore against
prefill, RSS at two context sizes, KV bytes per token, and q8_0 against f16 perplexity.

    python tools/bench_kv.py [-m MODEL] [-t THREADS] [--tests prefix,session,rss,bytes,ppl,reserve]

prefix:  a 4-turn chat on the model (default: the default model) whose first user message is
         about 1,000 tokens of this project's own source; for each later turn, TTFT with the
         earlier turns in the prefix cache against TTFT of the same prompt from a cold cache.
         Replies are greedy and 48 tokens long. Target: warm <= 15% of cold.
session: the last turn's prompt saved to a session file by one engine, restored by a fresh
         engine in this process; restore time (file read + KV import) against prefill time.
         Target: < 10%.
rss:     peak RSS of `edge run -n 16` in a child process at -c 4096 and -c 32768 (same prompt).
         Target: within 100 MB.
bytes:   KV bytes per token of every pulled registry model for f16, q8_0 and f32.
ppl:     `edge perplexity` on ../shared/golden/ppl_text.txt (-c 256) with f16 and q8_0 KV.
         Target: within 1%.
reserve: (not in the default list) prefill of 512 tokens and 128 greedy decode steps in a
         fresh pool file under $EDGE_HOME/kv, with its disk reservation (PagedKVCache.reserve:
         posix_fallocate of the blocks a forward writes) and with the reservation made a no-op
         (how the pool ran before it), alternating, medians of 5; and the time spent reserving.
         Target: no measurable difference.
Prints markdown tables.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["What does this code do? Answer in two sentences.",
             "Which function would you test first, and why?",
             "Suggest one better name for a variable in it.",
             "Summarize our conversation in one sentence."]


def _history_text(n_chars: int = 3600) -> str:
    src = (ROOT / "edge" / "kv" / "cache.py").read_text()
    return "Here is some Python code:\n\n```python\n" + src[:n_chars] + "\n```"


def _ttft(engine, ids) -> tuple[float, list[int], int]:
    from edge.engine import GenerationStats
    from edge.sampling import SamplingParams

    stats = GenerationStats()
    toks = list(engine.generate(ids, SamplingParams(temperature=0.0), 48, stats))
    return stats.ttft, toks, stats.n_cached


def bench_prefix(engine) -> list[str]:
    messages = [{"role": "user", "content": _history_text() + "\n\n" + QUESTIONS[0]}]
    rows = ["| turn | prompt tokens | reused from cache | TTFT warm (ms) | TTFT cold (ms) | warm / cold |",
            "|---|---|---|---|---|---|"]
    engine.clear_kv_cache()
    for turn in range(4):
        ids = engine.chat_prompt(messages)
        warm, toks, n_cached = _ttft(engine, ids)
        reply = engine.tokenizer.decode(toks).decode("utf-8", "replace")
        if turn:
            keep = engine.kv                                  # the warm cache, back after the cold runs
            colds = []
            for _ in range(2):
                engine._kv = None                             # a new, empty cache each time
                colds.append(_ttft(engine, ids)[0])
                engine.clear_kv_cache()
            cold = min(colds)
            engine._kv = keep
            rows.append(f"| {turn + 1} | {len(ids)} | {n_cached} | {warm * 1e3:.0f} | {cold * 1e3:.0f} | "
                        f"{warm / cold:.1%} |")
        else:
            rows.append(f"| 1 | {len(ids)} | {n_cached} | {warm * 1e3:.0f} | (cold) | |")
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": QUESTIONS[(turn + 1) % 4]}]
    return rows


def bench_session(path, threads: int) -> list[str]:
    from edge.engine import Engine, GenerationStats
    from edge.sampling import SamplingParams
    from edge.session import load_session

    eng = Engine(path)
    ids = eng.chat_prompt([{"role": "user", "content": _history_text()}])
    f = Path(os.environ.get("TMPDIR", "/tmp")) / f"edge-bench-{os.getpid()}.session"
    try:
        t = time.perf_counter()
        list(eng.generate(ids, SamplingParams(temperature=0.0), 0, GenerationStats(), session=f))
        prefill = time.perf_counter() - t
        fresh = Engine(path)
        fresh.kv                                              # the pool exists before timing
        t = time.perf_counter()
        s = load_session(f, fresh)
        fresh.kv.import_sequence(s.tokens, s.ks, s.vs)
        restore = time.perf_counter() - t
        size = f.stat().st_size
    finally:
        f.unlink(missing_ok=True)
    return ["| prompt tokens | prefill + save (ms) | restore (ms) | restore / prefill | file (MB) |",
            "|---|---|---|---|---|",
            f"| {len(ids)} | {prefill * 1e3:.0f} | {restore * 1e3:.1f} | {restore / prefill:.1%} | {size / 1e6:.1f} |"]


def _child_rss(cmd: list[str]) -> float:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.read().decode()[-500:]}")
    return usage.ru_maxrss / 1024  # Linux: kB


def bench_rss(model: str, threads: int) -> list[str]:
    rows = ["| -c | peak RSS (MB) |", "|---|---|"]
    for n_ctx in (4096, 32768):
        rss = _child_rss([sys.executable, "-m", "edge.cli", "run", "-m", model, "-t", str(threads), "-c", str(n_ctx),
                          "-n", "16", "--temp", "0", "Write a Python function that reverses a string."])
        rows.append(f"| {n_ctx} | {rss:.0f} |")
    return rows


def bench_bytes() -> list[str]:
    from edge.gguf_file import GGUFFile
    from edge.kv.cache import kv_bytes_per_token
    from edge.models import load_model
    from edge.store import REGISTRY, model_path

    rows = ["| model | f16 | q8_0 | f32 | f16 at n_ctx 4096 (MB) |", "|---|---|---|---|---|"]
    for name in REGISTRY:
        p = model_path(name)
        if not p.is_file():
            continue
        a = load_model(GGUFFile(p)).args
        b = {t: kv_bytes_per_token(a, t, t) for t in ("f16", "q8_0", "f32")}
        rows.append(f"| {name} | {b['f16']} | {b['q8_0']} | {b['f32']} | {b['f16'] * 4096 / 2**20:.0f} |")
    return rows


def bench_ppl(model: str, threads: int) -> list[str]:
    text = ROOT.parent / "shared" / "golden" / "ppl_text.txt"
    rows = ["| KV type | perplexity | vs f16 |", "|---|---|---|"]
    base = None
    for t in ("f16", "q8_0"):
        out = subprocess.run([sys.executable, "-m", "edge.cli", "perplexity", "-m", model, "-t", str(threads),
                              "-f", str(text), "-c", "256", "-ctk", t, "-ctv", t],
                             capture_output=True, text=True, check=True).stdout
        ppl = float(re.search(r"PPL = ([0-9.]+)", out).group(1))
        base = base or ppl
        rows.append(f"| {t} | {ppl:.4f} | {ppl / base - 1:+.2%} |")
    return rows


def bench_reserve(path, reps: int = 5) -> list[str]:
    import statistics

    import numpy as np

    from edge.engine import Engine
    from edge.generate import forward
    from edge.kv.cache import PagedKVCache

    eng = Engine(path)
    ids = eng.raw_prompt(_history_text(8000))[:512]
    real = PagedKVCache._back_positions
    spent = [0.0]

    def timed(self, *args):
        t = time.perf_counter()
        real(self, *args)
        spent[0] += time.perf_counter() - t

    runs = {on: {"pp": [], "tg": [], "pp_in": [], "tg_in": []} for on in (True, False)}
    for _ in range(reps):
        for on in (True, False):
            PagedKVCache._back_positions = timed if on else (lambda self, *args: None)
            kv = PagedKVCache(eng.model.args, eng.n_ctx, 1, eng.block_size, storage="file")
            try:
                assert kv.storage == "file", "the pool file could not be made under $EDGE_HOME/kv"
                spent[0] = 0.0
                t = time.perf_counter()
                slot, _ = kv.new_sequence(ids)
                tok = int(np.argmax(eng.prefill(ids, kv, seq=slot)))
                runs[on]["pp"].append(len(ids) / (time.perf_counter() - t))
                runs[on]["pp_in"].append(spent[0])
                spent[0] = 0.0
                t = time.perf_counter()
                for _ in range(128):
                    kv.append(slot, [tok])
                    tok = int(np.argmax(forward(eng.model, [tok], kv)[-1]))
                runs[on]["tg"].append(128 / (time.perf_counter() - t))
                runs[on]["tg_in"].append(spent[0] / 128)
            finally:
                PagedKVCache._back_positions = real
                kv.close()
    med = {on: {k: statistics.median(v) for k, v in r.items()} for on, r in runs.items()}
    rows = ["| disk reservation | pp512 tokens/s | tg128 tokens/s | reserving per prefill (ms) | "
            "reserving per decode step (us) |", "|---|---|---|---|---|"]
    for on in (True, False):
        m = med[on]
        rows.append(f"| {'on' if on else 'off (before)'} | {m['pp']:.1f} | {m['tg']:.2f} | "
                    + (f"{m['pp_in'] * 1e3:.2f} | {m['tg_in'] * 1e6:.1f} |" if on else "- | - |"))
    rows.append(f"\n{len(ids)} prompt tokens, medians of {reps} alternating runs; all runs (on): pp "
                + ", ".join(f"{x:.0f}" for x in runs[True]["pp"]) + "; (off): "
                + ", ".join(f"{x:.0f}" for x in runs[False]["pp"]) + "; tg (on): "
                + ", ".join(f"{x:.1f}" for x in runs[True]["tg"]) + "; (off): "
                + ", ".join(f"{x:.1f}" for x in runs[False]["tg"]))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--tests", default="prefix,session,rss,bytes,ppl")
    args = ap.parse_args()
    import numba

    from edge.engine import Engine
    from edge.store import resolve_model

    numba.set_num_threads(args.threads)
    path = resolve_model(args.model)
    tests = args.tests.split(",")
    print(f"# KV cache: {args.model}, {args.threads} threads\n")
    if "prefix" in tests:
        print("## Prefix caching, 4-turn chat\n", *bench_prefix(Engine(path)), "", sep="\n")
    if "session" in tests:
        print("## Session restore\n", *bench_session(path, args.threads), "", sep="\n")
    if "rss" in tests:
        print("## Peak RSS\n", *bench_rss(args.model, args.threads), "", sep="\n")
    if "bytes" in tests:
        print("## KV bytes per token\n", *bench_bytes(), "", sep="\n")
    if "ppl" in tests:
        print("## Perplexity by KV type (ppl_text.txt, -c 256)\n", *bench_ppl(args.model, args.threads), "", sep="\n")
    if "reserve" in tests:
        print("## Disk reservation of the pool file\n", *bench_reserve(path), "", sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
