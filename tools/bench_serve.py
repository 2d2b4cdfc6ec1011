"""Load generator for OpenAI-compatible servers on loopback: `edge serve` and, for comparison,
llama-cpp-python's server (python -m llama_cpp.server) on the same model file.

For each number of concurrent clients (default 1, 4, 8, 16), every client sends streamed chat
requests back to back (greedy, a fixed max_tokens, prompts from a fixed list) until it has
sent --requests or --time-limit seconds have passed. Reported per level: aggregate generated
tokens/s (completion tokens of all requests / wall time of the level), TTFT p50/p95 (request
sent -> first content chunk) and TPOT p50/p95 (per request: (last chunk - first chunk) /
(completion tokens - 1)), requests done and failed.

    python tools/bench_serve.py                       # starts edge serve on the default model
    python tools/bench_serve.py --url http://127.0.0.1:8080 --clients 1,8
    python tools/bench_serve.py --llama-python /path/to/python-with-llama-cpp-python[server]

Counts are bounded (requests per client, time per level), so a slow server ends the run too.
"""
from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in two sentences.",
    "Write a SQL query that counts orders per customer.",
    "What does the `yield` keyword do in Python?",
    "Write a bash one-liner that counts lines in all .py files.",
    "Give three tips for writing readable code.",
    "Write a JavaScript function that debounces another function.",
    "What is the difference between a process and a thread?",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(url: str, path: str, timeout: float, proc: subprocess.Popen) -> None:
    u = urllib.parse.urlparse(url)
    t_end = time.time() + timeout
    while time.time() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection(u.hostname, u.port, timeout=5)
            c.request("GET", path)
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout} s")


def one_request(url: str, model: str | None, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy chat request: {ttft, tpot, tokens} (seconds, seconds, count)."""
    u = urllib.parse.urlparse(url)
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    t_first = t_last = None
    n_chunks, usage = 0, None
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        obj = json.loads(line[6:])
        if obj.get("usage"):
            usage = obj["usage"]
        for ch in obj.get("choices") or []:
            if (ch.get("delta") or {}).get("content"):
                now = time.perf_counter()
                t_first = t_first or now
                t_last = now
                n_chunks += 1
    conn.close()
    tokens = usage["completion_tokens"] if usage else n_chunks
    if t_first is None:
        raise RuntimeError("no content streamed")
    tpot = (t_last - t_first) / (tokens - 1) if tokens > 1 else None
    return {"ttft": t_first - t0, "tpot": tpot, "tokens": tokens}


def run_level(url: str, model: str | None, clients: int, requests: int, max_tokens: int, time_limit: float) -> dict:
    results, failures = [], []
    lock = threading.Lock()
    t_start = time.perf_counter()
    deadline = t_start + time_limit

    def client(k: int) -> None:
        for i in range(requests):
            if time.perf_counter() > deadline:
                return
            try:
                r = one_request(url, model, PROMPTS[(k + i) % len(PROMPTS)], max_tokens)
                with lock:
                    results.append(r)
            except Exception as e:   # counted, reported
                with lock:
                    failures.append(str(e))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_start
    ttft = sorted(r["ttft"] for r in results)
    tpot = sorted(r["tpot"] for r in results if r["tpot"] is not None)

    def pct(xs, p):
        return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")

    return {"clients": clients, "requests": len(results), "failed": len(failures),
            "tokens": sum(r["tokens"] for r in results), "wall_s": wall,
            "tok_per_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95),
            "tpot_p50": pct(tpot, 50), "tpot_p95": pct(tpot, 95), "errors": failures[:3]}


def start_edge(model: str | None, n_parallel: int, n_ctx: int, threads: int | None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "edge.cli", "serve", "--port", str(port), "-np", str(n_parallel), "-c", str(n_ctx)]
    if model:
        cmd += ["-m", model]
    if threads:
        cmd += ["-t", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    _wait_health(url, "/health", 300, proc)
    return proc, url


def start_llama(python: str, model_path: str, n_ctx: int, threads: int | None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    # --interrupt_requests False: by default a new request cuts the running stream short
    cmd = [python, "-m", "llama_cpp.server", "--model", model_path, "--port", str(port), "--n_ctx", str(n_ctx),
           "--n_batch", "512", "--interrupt_requests", "False"]
    if threads:
        cmd += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait_health(url, "/v1/models", 300, proc)
    return proc, url


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="an already running server (else edge serve is started)")
    ap.add_argument("-m", "--model", default=None, help="edge model name or .gguf path (default model when absent)")
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--requests", type=int, default=3, help="requests per client per level (default 3)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=180, help="seconds per level before clients stop sending")
    ap.add_argument("-c", "--ctx-size", type=int, default=2048)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--llama-python", default=None,
                    help="interpreter with llama-cpp-python[server]: run the same load against its server")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.clients.split(",")]
    procs, report = [], {}

    def load(name: str, url: str) -> None:
        # warm up, results discarded: one request alone, then one per client of the largest level
        # at once (first use of the batched code paths in the process: compile or cache load)
        one_request(url, None, PROMPTS[0], 4)
        run_level(url, None, max(levels), 1, 8, args.time_limit)
        report[name] = []
        for n in levels:
            r = run_level(url, None, n, args.requests, args.max_tokens, args.time_limit)
            report[name].append(r)
            if not args.json:
                print(f"{name:6} clients {n:2}: {r['tok_per_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50']*1000:7.0f} ms "
                      f"p95 {r['ttft_p95']*1000:7.0f} ms  TPOT p50 {r['tpot_p50']*1000:6.1f} ms p95 "
                      f"{r['tpot_p95']*1000:6.1f} ms  ({r['requests']} requests, {r['failed']} failed)", flush=True)

    try:
        if args.url:
            load("edge", args.url)
        else:
            proc, url = start_edge(args.model, max(levels), args.ctx_size, args.threads)
            procs.append(proc)
            load("edge", url)
            proc.terminate()
            proc.wait(60)
        if args.llama_python:
            from edge.store import resolve_model
            proc, url = start_llama(args.llama_python, str(resolve_model(args.model)), args.ctx_size, args.threads)
            procs.append(proc)
            load("llama", url)
        if not args.json:
            base = report["edge"][0]["tok_per_s"]
            print("edge aggregate vs 1 client: " + ", ".join(
                f"{r['clients']}: {r['tok_per_s'] / base:.2f}x" for r in report["edge"]))
            for e, l in zip(report["edge"], report.get("llama", [])):
                print(f"clients {e['clients']:2}: edge / llama-cpp-python server tokens/s = "
                      f"{e['tok_per_s'] / l['tok_per_s']:.2f}")
        else:
            print(json.dumps(report, indent=1))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
