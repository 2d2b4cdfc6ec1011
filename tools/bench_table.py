#!/usr/bin/env python3
"""edge beside llama.cpp on the registry's models: a markdown table from `edge bench --vs-llama-cpp --json`.

    python tools/bench_table.py [--models a,b,c] [--llama-python PATH] [--readme] [--save-json DIR]
                                [-- EDGE BENCH OPTIONS, e.g. -t 2 -r 5]

Runs one `edge bench` process per model (this interpreter; llama.cpp in the interpreter given by
--llama-python), then prints the table with the machine (CPU model, cores, threads), the date,
edge's commit and llama-cpp-python's version. --readme also writes it into README.md between
`<!-- bench-table:start -->` and `<!-- bench-table:end -->`. Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["qwen2.5-coder-0.5b-instruct", "gemma-3-270m", "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"]
START, END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what the platform module says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def edge_commit() -> str:
    """Short commit of the checkout, '+changes' when the working tree differs from it."""
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def run_model(model: str, llama_python: str, extra: list[str]) -> dict:
    """One `edge bench --vs-llama-cpp --json` process; its result (see edge.bench)."""
    cmd = [sys.executable, "-m", "edge.cli", "bench", "-m", model, "--vs-llama-cpp",
           "--llama-python", llama_python, "--json", *extra]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # progress goes to our stderr
    if proc.returncode != 0:
        raise RuntimeError(f"edge bench on {model} failed with status {proc.returncode}")
    return json.loads(proc.stdout)


def _tps(r: dict | None, scale: bool = False) -> str:
    if r is None:
        return "n/a"
    spread = 50 * (r["tps_max"] - r["tps_min"]) / r["tps"]
    s = f"{r['tps']:.1f} ±{spread:.0f}%"
    return s + (f" ({r['vs_1_seq']:.2f}x)" if scale and "vs_1_seq" in r else "")


_SAME = {True: "yes", False: "no", None: "n/a"}


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else fmt.format(x)


def _name(r: dict) -> str:
    return Path(r["model_path"]).stem  # the registry name for pulled models


def markdown(results: list[dict]) -> str:
    """The tables (and the machine line) for a list of edge.bench results."""
    first = results[0]
    lc_versions = sorted({r["llama_cpp"]["version"] for r in results if r["llama_cpp"] and r["llama_cpp"]["version"]})
    errors = [f"{_name(r)}: {r['llama_cpp']['error']}" for r in results if r["llama_cpp"] and r["llama_cpp"]["error"]]
    from edge.cli import physical_cores

    lines = [
        f"Machine: {cpu_model()}, {physical_cores()} cores ({os.cpu_count()} logical), "
        f"{first['threads']} threads; {datetime.date.today().isoformat()}; edge {edge_commit()}; "
        f"llama-cpp-python {', '.join(lc_versions) or 'n/a'} (flash attention off). "
        f"Tokens/s, median of {first['reps']} runs ± half their range; n_ctx {first['n_ctx']}, "
        f"n_batch {first['n_batch']}; `tgN xB`: B sequences decoding together, (1.00x): tokens/s relative to one sequence.",
        "",
        "| model | test | edge t/s | llama.cpp t/s | edge / llama.cpp | same greedy tokens | of ceiling edge / llama.cpp |",
        "|---|---|---:|---:|---:|:---:|---:|",
    ]
    for r in results:
        for row in r["tests"]:
            batched = row["kind"] == "batched"
            frac = [_num(row[k] and row[k].get("ceiling_fraction"), "{:.0%}") for k in ("edge", "llama_cpp")]
            lines.append(f"| {_name(r)} | {row['test']} | {_tps(row['edge'], batched)} | "
                         f"{_tps(row['llama_cpp'], batched)} | {_num(row['edge_over_llama_cpp'], '{:.2f}')} | "
                         f"{_SAME[row['tokens_equal']] if row['kind'] != 'pp' else ''} | {' / '.join(frac)} |")
    lines += ["", "| model | file | peak RSS MB edge / llama.cpp | load to first token s edge / llama.cpp "
                  "| fresh process to first token s edge / llama.cpp |",
              "|---|---:|---:|---:|---:|"]
    for r in results:
        cells = [f"{_num(r[k]['edge'], f)} / {_num(r[k]['llama_cpp'], f)}" for k, f in
                 (("peak_rss_mb", "{:.0f}"), ("load_to_first_token_s", "{:.2f}"), ("process_first_token_wall_s", "{:.2f}"))]
        lines.append(f"| {_name(r)} | {r['model_bytes'] / 2**20:.0f} MiB | " + " | ".join(cells) + " |")
    ceil = [(_name(r), r["ceilings"]) for r in results if r.get("ceilings")]
    if ceil:
        c = ceil[0][1]
        lines += ["", f"Ceilings measured in the run (`edge bench`, kernels_cpu/ceilings.py; path {c['kernel_path']}): "
                      f"memory read {c['read_gb_s']:.1f} GB/s, int8 {c['int8_gmacs']:.0f} G multiply-adds/s. "
                      "Of ceiling: the share of the roofline, pp tokens/s x multiply-adds per token / int8 rate; "
                      "tg and batched the larger of that and steps/s x weight bytes / read bandwidth. Per token: "
                      + "; ".join(f"{n} {x['weight_bytes_per_token'] / 1e6:.0f} MB, {x['macs_per_token'] / 1e9:.2f} G"
                                  for n, x in ceil) + "."]
    if errors:
        lines += [""] + [f"llama.cpp n/a: {e}" for e in errors]
    return "\n".join(lines) + "\n"


def replace_between_markers(text: str, content: str) -> str:
    """``text`` with everything between START and END replaced by ``content``.
    Raises ValueError when the markers are missing or out of order."""
    i, j = text.find(START), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"README.md needs the markers {START} and {END}, in that order")
    return text[: i + len(START)] + "\n" + content + text[j:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated names or paths")
    ap.add_argument("--llama-python", default=sys.executable, help="interpreter with llama-cpp-python")
    ap.add_argument("--readme", action="store_true", help="also write the table into README.md")
    ap.add_argument("--save-json", type=Path, default=None, help="folder for each model's bench JSON")
    ap.add_argument("extra", nargs="*", help="options passed to edge bench (after --), e.g. -- -t 2 -r 5")
    args = ap.parse_args()
    results = []
    for model in args.models.split(","):
        res = run_model(model, args.llama_python, args.extra)
        results.append(res)
        if args.save_json:
            args.save_json.mkdir(parents=True, exist_ok=True)
            (args.save_json / f"{Path(model).name.removesuffix('.gguf')}.json").write_text(json.dumps(res, indent=1))
    table = markdown(results)
    print(table, end="")
    if args.readme:
        readme = ROOT / "README.md"
        readme.write_text(replace_between_markers(readme.read_text(encoding="utf-8"), table), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
