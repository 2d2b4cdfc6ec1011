#!/usr/bin/env python3
"""Time `edge quantize` beside llama.cpp's quantizer on the same source, type and threads.

    python tools/bench_quantize.py [SOURCE.gguf] [--type Q4_K_M] [-t 2] [-r 3] [--imatrix FILE]
                                   [--llama-python PATH] [--llama-quantize PATH]

SOURCE defaults to the gemma-3-270m F16 source the tests build ($EDGE_HOME/test-data/
gemma-3-270m-f16.gguf, made by ../shared/tools/make_f16_source.py). Each run is a fresh process
(`edge quantize`, wall time from start to exit: start-up, numba's cached kernels and the write
included), writing into a temporary folder. llama.cpp runs as the llama-quantize binary when --llama-quantize is given,
else as llama_model_quantize through llama-cpp-python in --llama-python (default
$EDGE_ORACLE_PYTHON or where tools/build_oracle.sh puts it, skipped when missing), both the same code (src/llama-quant.cpp). The
outputs are compared byte for byte. Prints the median of -r runs of each and their ratio.
Run it on an otherwise idle machine; the machine's load average is printed with the result.
"""
from __future__ import annotations

import argparse
import filecmp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_LLAMA_CHILD = r"""
import sys, time, llama_cpp
src, dst, ftype, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
p.nthread = threads
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p)
sys.exit(rc)
"""


def _timed(cmd: list[str]) -> float:
    """Wall seconds of one process; raises RuntimeError with its stderr when it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({proc.returncode}): {proc.stderr[-1500:]}")
    return seconds


def main() -> int:
    from edge.files import edge_home

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", nargs="?", default=str(edge_home() / "test-data" / "gemma-3-270m-f16.gguf"))
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--imatrix", default=None, help="quantize with this imatrix (both engines)")
    oracle = os.environ.get("EDGE_ORACLE_PYTHON") or str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                                                         / "edge-oracle/llama-cpp-python-0.3.36/venv/bin/python")
    ap.add_argument("--llama-python", default=oracle)
    ap.add_argument("--llama-quantize", default=None, help="llama-quantize binary (preferred over --llama-python)")
    args = ap.parse_args()
    src = Path(args.source)
    if not src.is_file():
        sys.exit(f"{src}: not found (the tests build it: pytest tests/test_quantize_file.py, or "
                 f"../shared/tools/make_f16_source.py)")
    with tempfile.TemporaryDirectory(prefix="bench-quantize-") as tmp:
        edge_out, llama_out = Path(tmp) / "edge.gguf", Path(tmp) / "llama.gguf"
        edge_cmd = [sys.executable, "-m", "edge.cli", "quantize", str(src), str(edge_out), args.type,
                    "-t", str(args.threads)] + (["--imatrix", args.imatrix] if args.imatrix else [])
        if args.llama_quantize:
            llama_cmd = [args.llama_quantize] + (["--imatrix", args.imatrix] if args.imatrix else []) + \
                        [str(src), str(llama_out), args.type, str(args.threads)]
            llama_name = "llama-quantize"
        elif Path(args.llama_python).is_file() and not args.imatrix:
            llama_cmd = [args.llama_python, "-c", _LLAMA_CHILD, str(src), str(llama_out), args.type, str(args.threads)]
            llama_name = "llama_model_quantize (llama-cpp-python)"
        else:
            llama_cmd, llama_name = None, None
        _timed(edge_cmd)                      # warm-up: numba's cache, the page cache of the source
        edge_s = [_timed(edge_cmd) for _ in range(args.repetitions)]
        llama_s = [_timed(llama_cmd) for _ in range(args.repetitions)] if llama_cmd else []
        same = filecmp.cmp(edge_out, llama_out, shallow=False) if llama_cmd else None
        load = os.getloadavg()[0]
    mib = src.stat().st_size / (1 << 20)
    print(f"{src.name} ({mib:.0f} MiB) -> {args.type}{' with imatrix' if args.imatrix else ''}, "
          f"-t {args.threads}, median of {args.repetitions} (load average {load:.2f})")
    print(f"  edge quantize: {statistics.median(edge_s):.2f} s  (runs: {', '.join(f'{s:.2f}' for s in edge_s)})")
    if llama_s:
        print(f"  {llama_name}: {statistics.median(llama_s):.2f} s  (runs: {', '.join(f'{s:.2f}' for s in llama_s)})")
        print(f"  edge / llama.cpp: {statistics.median(edge_s) / statistics.median(llama_s):.2f}x; "
              f"outputs {'byte-equal' if same else 'DIFFER'}")
    else:
        print("  llama.cpp: not run (give --llama-quantize or a --llama-python with llama-cpp-python)")
    return 0 if same is not False else 1


if __name__ == "__main__":
    sys.exit(main())
