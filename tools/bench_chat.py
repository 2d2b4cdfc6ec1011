"""TTFT of a chat's first and second turn in `edge chat`, read off the app's status bar.

The app runs headless (textual's Pilot, 80x24) on a model (default: the default model),
greedy. After a short warm-up exchange and /new, turn 1 sends a ~550-token message (a code
review request) and gets an answer of up to -n tokens (a first exchange of about 600 tokens);
turn 2 sends a short follow-up. Turn 2 reuses turn 1's KV cache (the chat's session file),
so its TTFT covers only its own new tokens.

    python tools/bench_chat.py [-m MODEL] [-n 48] [-t THREADS]
"""
from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge.chat import ChatSettings  # noqa: E402
from tui.app import ChatApp, ChatInput, ChatOptions  # noqa: E402

CODE = '''def parse_config(path):
    settings = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=")
            settings[key.strip()] = value.strip()
    return settings


def merge(a, b):
    out = dict(a)
    for k, v in b.items():
        if k in out and isinstance(out[k], dict) and isinstance(v, dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


class Cache:
    def __init__(self, size):
        self.size = size
        self.data = {}
        self.order = []

    def get(self, key):
        if key in self.data:
            self.order.remove(key)
            self.order.append(key)
            return self.data[key]
        return None

    def put(self, key, value):
        if key in self.data:
            self.order.remove(key)
        elif len(self.data) >= self.size:
            oldest = self.order.pop(0)
            del self.data[oldest]
        self.data[key] = value
        self.order.append(key)


def retry(fn, times=3):
    for i in range(times):
        try:
            return fn()
        except Exception as e:
            last = e
    raise last


def chunks(items, n):
    return [items[i:i + n] for i in range(0, len(items), n)]
'''

TURN1 = ("Please review this Python module. List the bugs and the performance problems you see, "
         "and say how to fix each one.\n\n```python\n" + CODE + CODE[: len(CODE) * 3 // 5] + "```")
TURN2 = "Which of these problems would you fix first, and why?"


async def _run(model: str | None, n: int, folder: Path) -> tuple[float, float, int]:
    opts = ChatOptions(model=model, settings=ChatSettings(temperature=0.0, max_tokens=n), folder=folder)
    app = ChatApp(opts)
    async with app.run_test(size=(80, 24)) as pilot:
        async def until(pred, timeout=600):
            t0 = time.monotonic()
            while not pred():
                if time.monotonic() - t0 > timeout:
                    raise SystemExit("timed out")
                await pilot.pause(0.05)

        async def send(text: str) -> float:
            box = app.query_one("#input", ChatInput)
            box.text = text
            before = app.turns_ended
            await pilot.press("enter")
            await until(lambda: app.turns_ended > before)
            await pilot.pause(0.1)
            status = str(app.query_one("#status").content)
            m = re.search(r"TTFT ([0-9.]+) s", status)
            if not m:
                raise SystemExit(f"no TTFT in the status bar: {status!r}")
            return float(m.group(1))

        await until(lambda: app.runner is not None and not app.loading)
        await send("Hi.")                         # warm-up: kernels loaded, caches touched
        app.run_command("/new")
        t1 = await send(TURN1)
        after1 = app.n_tokens
        t2 = await send(TURN2)
        return t1, t2, after1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-n", "--max-tokens", type=int, default=48)
    ap.add_argument("-t", "--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        import numba
        numba.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        t1, t2, n1 = asyncio.run(_run(args.model, args.max_tokens, Path(tmp)))
    print(f"first exchange: {n1} tokens")
    print(f"turn 1 TTFT: {t1:.2f} s")
    print(f"turn 2 TTFT: {t2:.2f} s ({t2 / t1:.1%} of turn 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
