"""edge's answers on other x86-64 CPUs, without the hardware (issue 23): each target runs in a
subprocess whose numba compiles for that CPU (NUMBA_CPU_NAME and NUMBA_CPU_FEATURES), so edge
takes that CPU's kernel paths (kernels_cpu.simd.kernel_path), with a numba cache of its own.

Per target it computes the logits of
  (a) the tiny random-weight models of tests/arch_cases.py and tests/iq_cases.py (every
      architecture and weight type there): every position of each fixture prompt in one batch,
      then the decode steps fed llama.cpp's greedy tokens (tests/test_arch_llama_cpp.py's runs);
  (b) the greedy golden continuations of the registry models (../shared/golden/<id>/greedy.json):
      edge's own greedy tokens from each prompt, with every step's logits;
and compares them bit for bit with the host's run (this machine's own CPU, edge's reference:
the AVX-512 VNNI host the kernels were written on), reporting per target pass/fail, the largest
|difference| of a logit and the time; each target is also held to llama.cpp's stored outputs
(tests' tolerances for (a), greedy.json's tokens up to a near-tie for (b)).

NUMBA_CPU_NAME alone does not change the instruction set: numba then passes the host's features
(NUMBA_CPU_FEATURES unset), so each target lists its CPU's features (TARGETS). numba's cache key
holds both (codegen.magic_tuple: triple, CPU name, features), so targets never share a compiled
kernel; a cache folder per target keeps their index files apart and makes cold times measurable.

Code compiled for a target runs on this machine, so a target can use only the instructions the
host has: a feature of a target's CPU that the host lacks (alderlake's AVX-VNNI on an AMD Zen 4)
is turned off for the run and named in the report (with AVX-VNNI, LLVM fuses vpmaddwd + add
into {vex} vpdpwssd: SIGILL on Zen 4), and the target then takes the path of the features left
(alderlake: "avx2", not its own "avx-vnni"). The avx-vnni tiles' integer step, vpdpbusd ymm, is
the one AVX-512 VNNI hosts run EVEX-encoded: tests/test_kquant_int8.py checks those tiles bit for
bit on such a host and their VEX encoding in alderlake's assembly.

    python tools/check_targets.py                         # every target, every case
    python tools/check_targets.py -t haswell -c llama3-q8_0 -g gemma3-270m:0
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_BASE = "+64bit,+cmov,+cx8,+fxsr,+mmx,+sse,+sse2"
_NEHALEM = _BASE + ",+sse3,+ssse3,+sse4.1,+sse4.2,+popcnt,+crc32,+cx16,+sahf"
_HASWELL = _NEHALEM + (",+pclmul,+avx,+xsave,+xsaveopt,+f16c,+fsgsbase,+rdrnd,+avx2,+bmi,+bmi2,+fma,+invpcid,"
                       "+lzcnt,+movbe")
_SKYLAKE = _HASWELL + ",+adx,+aes,+rdseed,+prfchw,+clflushopt,+xsavec,+xsaves"
# name -> (NUMBA_CPU_NAME, the CPU's features as LLVM names them; the lists of GCC's -march and
# LLVM's X86.td). "host": this machine as it is (no variable set), the reference.
TARGETS = {
    "host": (None, None),
    "znver4": ("znver4", _SKYLAKE + ",+avx512f,+avx512cd,+avx512bw,+avx512dq,+avx512vl,+avx512vnni,+avx512bf16,"
                                    "+avx512bitalg,+avx512ifma,+avx512vbmi,+avx512vbmi2,+avx512vpopcntdq,+clwb,+clzero,"
                                    "+gfni,+vaes,+vpclmulqdq,+sha,+rdpid,+sse4a,+mwaitx,+wbnoinvd,+shstk,+pku"),
    "skylake-avx512": ("skylake-avx512", _SKYLAKE + ",+avx512f,+avx512cd,+avx512bw,+avx512dq,+avx512vl,+clwb,+pku"),
    "alderlake": ("alderlake", _SKYLAKE + ",+avxvnni,+gfni,+vaes,+vpclmulqdq,+sha,+rdpid,+clwb,+pku,+movdiri,"
                                          "+movdir64b,+waitpkg,+serialize,+ptwrite,+hreset,+kl,+widekl,+cldemote,"
                                          "+pconfig,+shstk"),
    "haswell": ("haswell", _HASWELL),
    "x86-64": ("x86-64", _BASE),
}
DEFAULT_TARGETS = [t for t in TARGETS if t != "host"]
N_CTX = 64          # the tiny cases' context (tests/test_arch_llama_cpp.py)
GOLDEN_CTX = 512


def host_features() -> set[str]:
    """The features this machine's CPU has, as LLVM names them ("avx2", ...)."""
    from llvmlite import binding

    return {f[1:] for f in binding.get_host_cpu_features().flatten().split(",") if f.startswith("+")}


def target_env(target: str, cache_root: Path, host: set[str] | None = None) -> tuple[dict, list[str]]:
    """(the environment of ``target``'s subprocess, the target's features turned off because the
    host lacks them). Raises KeyError for an unknown target."""
    cpu, features = TARGETS[target]
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
    env["NUMBA_CACHE_DIR"] = str(cache_root / target)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    dropped: list[str] = []
    if cpu is not None:
        host = host_features() if host is None else host
        names = [f[1:] for f in features.split(",")]
        dropped = [f for f in names if f not in host]
        env["NUMBA_CPU_NAME"] = cpu
        env["NUMBA_CPU_FEATURES"] = ",".join(("-" if f in dropped else "+") + f for f in names)
    return env, dropped


def expected_path(target: str, host: set[str] | None = None) -> str:
    """The kernel path ``target``'s features give (kernels_cpu.simd.kernel_path), the host's for
    "host"; with ``host`` (the host's features), the path it can run here (without those the
    host lacks)."""
    from kernels_cpu import simd

    cpu, features = TARGETS[target]
    if cpu is None:
        return simd.kernel_path(frozenset("+" + f for f in host_features()))
    return simd.kernel_path(frozenset(f for f in features.split(",") if host is None or f[1:] in host))


# ------------------------------------------------------------------------------------- cases


def tiny_cases() -> list[str]:
    """Every tiny case with a llama.cpp fixture: tests/arch_cases.py's and tests/iq_cases.py's."""
    from tests.arch_cases import ARCH_CASES
    from tests.iq_cases import IQ_CASES

    return sorted(ARCH_CASES) + sorted(IQ_CASES)


def golden_cases() -> list[str]:
    """Every greedy golden prompt of the registry models, as "<golden id>:<index>"."""
    from tests.conftest import GOLDEN

    out = []
    for gid in ("gemma3-270m", "qwen2.5-coder-0.5b", "smollm2-135m"):
        cases = json.loads((GOLDEN / gid / "greedy.json").read_text())["cases"]
        out += [f"{gid}:{i}" for i in range(len(cases))]
    return out


def _tiny_model(name: str, tmp: Path):
    from edge.gguf_file import GGUFFile
    from edge.models import load_model
    from tests.arch_cases import ARCH_CASES
    from tests.tiny_models import write_tiny_model

    if name in ARCH_CASES:
        path = write_tiny_model(tmp / f"{name}.gguf", **ARCH_CASES[name])
    else:
        path = ROOT / "tests" / "data" / "arch" / "iq" / f"{name}.gguf"
    return load_model(GGUFFile(path))


def _fixture(name: str) -> dict:
    return dict(np.load(ROOT / "tests" / "data" / "arch" / f"{name}.npz"))


def _prompts(z: dict) -> list[int]:
    return sorted(int(k[1:].split("_")[0]) for k in z if k.endswith("_ids"))


def run_tiny(name: str, tmp: Path) -> dict[str, np.ndarray]:
    """Logits of tiny case ``name``: per fixture prompt k, "<name>/p<k>/prompt" (every position
    in one batch) and "<name>/p<k>/decode" (the prompt, then one step per llama.cpp greedy token)."""
    model, z = _tiny_model(name, tmp), _fixture(name)
    out = {}
    for k in _prompts(z):
        ids, greedy = z[f"p{k}_ids"], z[f"p{k}_greedy"]
        out[f"{name}/p{k}/prompt"] = model.forward(ids, model.new_cache(N_CTX), slice(None))
        cache = model.new_cache(N_CTX)
        rows = [model.forward(ids, cache)[0]]
        rows += [model.forward([int(t)], cache)[0] for t in greedy[:-1]]
        out[f"{name}/p{k}/decode"] = np.stack(rows)
    return out


_engines: dict = {}


def run_golden(case: str) -> dict[str, np.ndarray]:
    """Greedy continuation of golden prompt ``case`` ("<id>:<i>") for as many tokens as
    llama.cpp's: "golden/<case>/tokens" and "golden/<case>/logits" (each step's logits)."""
    from tests.conftest import GOLDEN, real_model_path
    from edge.engine import Engine

    gid, i = case.split(":")
    ref = json.loads((GOLDEN / gid / "greedy.json").read_text())["cases"][int(i)]
    if gid not in _engines:
        _engines[gid] = Engine(real_model_path(gid), n_ctx=GOLDEN_CTX)
    model = _engines[gid].model
    cache = model.new_cache(GOLDEN_CTX)
    row = model.forward(ref["prompt_ids"], cache)[0]
    tokens, rows = [], []
    for _ in range(len(ref["greedy_ids"])):
        rows.append(row)
        tokens.append(int(np.argmax(row)))
        row = model.forward([tokens[-1]], cache)[0]
    return {f"golden/{case}/tokens": np.array(tokens), f"golden/{case}/logits": np.stack(rows)}


def worker(out: Path, tiny: list[str], goldens: list[str]) -> None:
    """Run the cases in this process (its numba target) and save their logits to ``out`` (npz),
    with "meta" (JSON: kernel path, numba target, seconds per case, import seconds)."""
    t0 = time.perf_counter()
    from kernels_cpu import simd
    from edge.models import load_model  # noqa: F401  (the import's cost, counted apart)

    meta = {"kernel_path": simd.kernel_path(), "cpu": simd.cpu_target(), "import_s": time.perf_counter() - t0,
            "seconds": {}}
    arrays: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in tiny:
            t = time.perf_counter()
            arrays.update(run_tiny(name, Path(tmp)))
            meta["seconds"][name] = time.perf_counter() - t
    for case in goldens:
        t = time.perf_counter()
        arrays.update(run_golden(case))
        meta["seconds"][case] = time.perf_counter() - t
    np.savez(out, meta=np.array(json.dumps(meta)), **arrays)


# ------------------------------------------------------------------------------------- checks


def check_llama_cpp(arrays: dict, tiny: list[str], goldens: list[str]) -> list[str]:
    """Problems of one run against llama.cpp's stored outputs, with the tests' rules: tiny cases
    within tests/test_arch_llama_cpp.py's TOLERANCE, argmax equal where llama.cpp's top-2 are
    TIE_GAP apart; golden tokens equal to greedy.json's until a step whose top-2 gap was < 0.3."""
    from tests.conftest import GOLDEN
    from tests.test_arch_llama_cpp import TIE_GAP, TOLERANCE

    problems = []
    for name in tiny:
        z = _fixture(name)
        for k in _prompts(z):
            for kind, ref in (("prompt", z[f"p{k}_logits"]), ("decode", z[f"p{k}_greedy_logits"])):
                got = arrays[f"{name}/p{k}/{kind}"]
                err = float(np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max())
                if err > TOLERANCE[name.rsplit("-", 1)[1]]:
                    problems.append(f"{name} p{k} {kind}: error {err:.2e} of the largest logit vs llama.cpp")
                top2 = np.sort(ref, axis=1)[:, -2:]
                sure = top2[:, 1] - top2[:, 0] >= TIE_GAP
                if (got.argmax(1) != ref.argmax(1))[sure].any():
                    problems.append(f"{name} p{k} {kind}: another argmax than llama.cpp's at a clear lead")
    for case in goldens:
        gid, i = case.split(":")
        ref = json.loads((GOLDEN / gid / "greedy.json").read_text())["cases"][int(i)]
        got = arrays[f"golden/{case}/tokens"].tolist()
        for j, (a, b) in enumerate(zip(got, ref["greedy_ids"])):
            if a != b:
                if ref["top1_minus_top2"][j] >= 0.3:
                    problems.append(f"golden {case}: token {j} is {a}, llama.cpp {b} "
                                    f"(its top-2 gap {ref['top1_minus_top2'][j]})")
                break
    return problems


def compare(ref: dict, got: dict) -> tuple[int, int, float, list[str]]:
    """(arrays bit-equal, arrays compared, max |difference| of a logit, keys that differ) of
    a target's run against the host's."""
    keys = [k for k in ref if k != "meta"]
    differ, worst = [], 0.0
    for k in keys:
        a, b = ref[k], got.get(k)
        if b is None or a.shape != b.shape:
            differ.append(k)
            worst = float("inf")
        elif not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            differ.append(k)
            if a.dtype.kind == "f":
                worst = max(worst, float(np.abs(a.astype(np.float64) - b).max()))
    return len(keys) - len(differ), len(keys), worst, differ


def run_target(target: str, tiny: list[str], goldens: list[str], cache_root: Path, out_dir: Path,
               timeout: float | None = None) -> dict:
    """Run the cases under ``target`` in a subprocess; returns {"target", "dropped", "seconds",
    "returncode", "stderr", "arrays" (or None), "meta"}."""
    env, dropped = target_env(target, cache_root)
    out = out_dir / f"{target}.npz"
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", str(out),
            "-c", ",".join(tiny) or "none", "-g", ",".join(goldens) or "none"]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    res = {"target": target, "dropped": dropped, "seconds": time.perf_counter() - t0, "returncode": proc.returncode,
           "stderr": proc.stderr[-3000:], "arrays": None, "meta": None}
    if proc.returncode == 0:
        z = np.load(out)
        res["arrays"] = {k: z[k] for k in z.files if k != "meta"}
        res["meta"] = json.loads(str(z["meta"]))
    return res


def check(targets: list[str], tiny: list[str], goldens: list[str], cache_root: Path, log=print,
          timeout: float | None = None) -> list[dict]:
    """Run the host, then every target; returns one report per target: {"target", "kernel_path",
    "cpu", "dropped", "seconds", "bit_equal", "compared", "max_diff", "differ", "llama_cpp"
    (problems), "error", "ok"}."""
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        host = run_target("host", tiny, goldens, cache_root, Path(tmp), timeout)
        if host["arrays"] is None:
            raise RuntimeError(f"the host run failed (exit {host['returncode']}):\n{host['stderr']}")
        log(f"host: {host['meta']['kernel_path']} ({host['meta']['cpu']}), {host['seconds']:.0f} s")
        for target in ["host"] + [t for t in targets if t != "host"]:
            r = host if target == "host" else run_target(target, tiny, goldens, cache_root, Path(tmp), timeout)
            rep = {"target": target, "dropped": r["dropped"], "seconds": r["seconds"], "kernel_path": None, "cpu": None,
                   "bit_equal": 0, "compared": 0, "max_diff": None, "differ": [], "llama_cpp": [], "error": None}
            if r["arrays"] is None:
                rep["error"] = f"exit {r['returncode']}: {r['stderr'][-1500:]}"
            else:
                rep["kernel_path"], rep["cpu"] = r["meta"]["kernel_path"], r["meta"]["cpu"]
                rep["case_seconds"] = r["meta"]["seconds"]
                rep["bit_equal"], rep["compared"], rep["max_diff"], rep["differ"] = compare(host["arrays"], r["arrays"])
                rep["llama_cpp"] = check_llama_cpp(r["arrays"], tiny, goldens)
            rep["ok"] = rep["error"] is None and not rep["differ"] and not rep["llama_cpp"]
            reports.append(rep)
            log(format_report(rep))
    return reports


def format_report(rep: dict) -> str:
    """One line (and the problems below it) of a target's report."""
    head = f"{rep['target']:<15} {'PASS' if rep['ok'] else 'FAIL'}  "
    if rep["error"]:
        return head + f"{rep['seconds']:.0f} s, {rep['error']}"
    line = (head + f"kernels {rep['kernel_path']:<12} {rep['bit_equal']}/{rep['compared']} bit-equal to the host, "
            f"max |diff| {rep['max_diff']:.3g}, llama.cpp {'ok' if not rep['llama_cpp'] else 'FAILS'}, "
            f"{rep['seconds']:.0f} s")
    if rep["dropped"]:
        line += f" (off, the host lacks them: {', '.join(rep['dropped'])})"
        if rep["target"] in TARGETS and rep["kernel_path"] != expected_path(rep["target"]):
            line += f"; NOT the target's own path, {expected_path(rep['target'])}"
    extra = [f"    differs: {k}" for k in rep["differ"][:20]] + [f"    llama.cpp: {p}" for p in rep["llama_cpp"][:20]]
    return "\n".join([line] + extra)


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring); exit status 0 when every target passes, 1 otherwise."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-t", "--targets", default=",".join(DEFAULT_TARGETS),
                    help=f"comma-separated, of {', '.join(TARGETS)} (default: all but host)")
    ap.add_argument("-c", "--cases", default="all", help="tiny cases, comma-separated ('all', 'none')")
    ap.add_argument("-g", "--goldens", default="all", help="golden prompts <id>:<i>, comma-separated ('all', 'none')")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "edge-targets"),
                    help="numba cache root, a folder per target (default: %(default)s)")
    ap.add_argument("--json", help="also write the reports to this file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    pick = lambda s, every: every() if s == "all" else [] if s == "none" else s.split(",")  # noqa: E731
    tiny, goldens = pick(a.cases, tiny_cases), pick(a.goldens, golden_cases)
    if a.worker:
        worker(Path(a.worker), tiny, goldens)
        return 0
    targets = a.targets.split(",")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        ap.error(f"unknown targets {unknown}; known: {', '.join(TARGETS)}")
    print(f"{len(tiny)} tiny cases, {len(goldens)} golden prompts; targets {', '.join(targets)}", flush=True)
    reports = check(targets, tiny, goldens, Path(a.cache), log=lambda s: print(s, flush=True))
    if a.json:
        Path(a.json).write_text(json.dumps(reports, indent=1))
    return 0 if all(r["ok"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
