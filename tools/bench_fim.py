"""Time to first token of /infill as an editor plugin sends it (llama.vscode), cold and then
with the prefix cache, against a running `edge serve` (or llama-server):

    python tools/bench_fim.py [--url http://127.0.0.1:8080] [--line 40] [-r 5]

The file is tools/data/edit_this_file.txt with the cursor at the start of --line: the lines above
are input_prefix, the rest input_suffix (llama-server keeps the last 3/4 of n_batch tokens of the
prefix and the first 1/4 of the suffix). Run N makes the file new with a first line of its own
("# run N") and its cursor N lines further, so nothing of its prompt is cached, asks a completion
at the cursor (first), then one more after a keystroke typed there (second: four spaces; the
prompt starts as the first's up to the cursor, those blocks are cached, the suffix after it is
computed again).
Greedy, streamed, n_predict 16; TTFT is the client's time to the first content event, prompt_ms
and prompt_n / cache_n the server's timings. Medians of -r runs.
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
from pathlib import Path
from urllib.parse import urlparse

FILE = Path(__file__).resolve().parent / "data" / "edit_this_file.txt"


def infill(url: str, prefix: str, suffix: str) -> tuple[float, dict]:
    """(client seconds to the first content event, the final event's timings)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=300)
    body = {"input_prefix": prefix, "input_suffix": suffix, "input_extra": [], "prompt": "", "n_predict": 16,
            "temperature": 0, "stream": True, "cache_prompt": True}
    t0 = time.perf_counter()
    conn.request("POST", "/infill", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    ttft, last = None, None
    for line in r:
        if not line.startswith(b"data: "):
            continue
        ev = json.loads(line[6:])
        if ttft is None and ev.get("content"):
            ttft = time.perf_counter() - t0
        last = ev
    conn.close()
    return (ttft if ttft is not None else time.perf_counter() - t0), last["timings"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--line", type=int, default=40, help="the cursor's line (1-based)")
    ap.add_argument("-r", "--runs", type=int, default=5)
    args = ap.parse_args()
    lines = FILE.read_text().splitlines(keepends=True)
    rows = {"first": [], "second": []}
    for run in range(args.runs):
        cursor = args.line - 1 + run        # a window of its own when the prefix is cut to its end
        prefix = f"# run {run} {time.time()}\n" + "".join(lines[:cursor])
        suffix = "".join(lines[cursor:])
        rows["first"].append(infill(args.url, prefix, suffix))
        rows["second"].append(infill(args.url, prefix + "    ", suffix))
    for name, got in rows.items():
        t = [g[1] for g in got]
        print(f"{name:6s}: TTFT {statistics.median(g[0] for g in got) * 1e3:7.1f} ms | server prompt_ms "
              f"{statistics.median(x['prompt_ms'] for x in t):7.1f} | prompt_n {statistics.median(x['prompt_n'] for x in t):5.0f}"
              f" | cache_n {statistics.median(x['cache_n'] for x in t):5.0f}")


if __name__ == "__main__":
    main()
