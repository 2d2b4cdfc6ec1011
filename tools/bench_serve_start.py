"""Time from `edge serve` start to a 200 from /health and to the first answer (cold or warm).

Usage: python tools/bench_serve_start.py [-m MODEL] [--cold] [--runs N]

--cold points numba at an empty cache folder (NUMBA_CACHE_DIR in a temporary directory), so
the server compiles every kernel as on a fresh machine; without it the kernels load from the
checkout's cache. Prints, per run, seconds to /health 200, to the first streamed token of a
chat request (sent as soon as /health is 200), and to its end, then the medians.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(model: str | None, cold: bool) -> tuple[float, float, float]:
    port = _port()
    env = dict(os.environ)
    tmp = tempfile.TemporaryDirectory() if cold else None
    if tmp is not None:
        env["NUMBA_CACHE_DIR"] = tmp.name
    cmd = [sys.executable, "-m", "edge.cli", "serve", "--port", str(port), "-np", "1", "--no-log-requests",
           *(["-m", model] if model else [])]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"edge serve exited with {proc.returncode}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                ok = conn.getresponse().status == 200
                conn.close()
                if ok:
                    break
            except OSError:
                pass
            time.sleep(0.05)
        t_health = time.monotonic() - t0
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        body = {"messages": [{"role": "user", "content": "Write a Python function that reverses a string."}],
                "max_tokens": 32, "temperature": 0, "stream": True}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        t_first = None
        for line in resp:
            if line.startswith(b"data: ") and b'"content":"' in line and b'"content":""' not in line:
                t_first = t_first or time.monotonic() - t0
        t_end = time.monotonic() - t0
        conn.close()
        return t_health, t_first or t_end, t_end
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if tmp is not None:
            tmp.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--cold", action="store_true", help="an empty numba cache: every kernel compiles")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for i in range(args.runs):
        h, f, e = one_run(args.model, args.cold)
        rows.append((h, f, e))
        print(f"run {i + 1}: /health 200 after {h:.2f} s, first token {f:.2f} s, answer done {e:.2f} s", flush=True)
    med = [statistics.median(r[k] for r in rows) for k in range(3)]
    print(f"median ({'cold' if args.cold else 'warm'} numba cache, {args.runs} runs): /health {med[0]:.2f} s, "
          f"first token {med[1]:.2f} s, done {med[2]:.2f} s")


if __name__ == "__main__":
    main()
