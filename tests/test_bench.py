"""edge bench: the JSON's keys and values on the real gemma-3-270m model with tiny sizes, token
counts, option errors. Values are checked, not speeds."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from edge.bench import FIRST_PROMPT, BenchConfig, EdgeRunner
from edge.cli import main
from edge.gguf_file import GGUFFile

P, N, BATCHED = 16, 4, (1, 2)
RESULT_KEYS = {"tps", "tps_min", "tps_max", "samples", "n_tokens"}
HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.fixture(scope="module")
def bench_json(gemma_path):
    """`edge bench --json` on gemma; --vs-llama-cpp with this interpreter (llama.cpp's side
    runs only if this interpreter has llama-cpp-python)."""
    argv = ["bench", "-m", str(gemma_path), "-p", str(P), "-n", str(N), "-r", "1", "-t", "2",
            "-B", ",".join(map(str, BATCHED)), "--json", "--vs-llama-cpp", "--llama-python", sys.executable]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue())


def test_json_keys_and_counts(bench_json, gemma_path):
    r = bench_json
    assert {"model", "model_path", "model_bytes", "threads", "n_ctx", "n_batch", "reps", "seed", "tests",
            "peak_rss_mb", "load_to_first_token_s", "process_first_token_wall_s", "cache_type_k", "cache_type_v",
            "llama_cpp"} <= set(r)
    assert r["model"] == "Gemma 3 270m"
    assert r["model_bytes"] == gemma_path.stat().st_size
    gf = GGUFFile(gemma_path)
    counted = {}
    for t in gf.tensors.values():
        counted[t.ggml_type.name] = counted.get(t.ggml_type.name, 0) + 1
    assert r["tensor_types"] == counted and sum(r["tensor_types"].values()) == len(gf.tensors)
    assert list(r["tensor_types"].values()) == sorted(counted.values(), reverse=True)
    assert (r["n_ctx"], r["n_batch"], r["reps"], r["cache_type_k"], r["cache_type_v"]) == (4096, 512, 1, "f16", "f16")
    assert r["batch_invariant"] is False                      # pp / tg with llama.cpp's kernel choice
    from kernels_cpu import simd
    assert r["kernels"] == {"path": simd.kernel_path(), "cpu": simd.cpu_target()}   # e.g. avx512-vnni, znver4
    assert [t["test"] for t in r["tests"]] == [f"pp{P}", f"tg{N}"] + [f"tg{N} x{b}" for b in BATCHED]
    asked = [P, N] + [b * N for b in BATCHED]
    for row, n_asked in zip(r["tests"], asked):
        e = row["edge"]
        assert RESULT_KEYS <= set(e)
        assert row["n_tokens_asked"] == n_asked
        assert e["n_tokens"] == n_asked, row["test"]          # positions filled / tokens generated
        assert len(e["samples"]) == 1
        assert 0 < e["tps_min"] <= e["tps"] <= e["tps_max"]
    batched = [row for row in r["tests"] if row["kind"] == "batched"]
    assert [row["n_seq"] for row in batched] == list(BATCHED)
    assert batched[0]["edge"]["vs_1_seq"] == 1.0
    assert batched[1]["edge"]["vs_1_seq"] == batched[1]["edge"]["tps"] / batched[0]["edge"]["tps"]
    # every weight page is read by a forward pass (the output matmul reads all of token_embd)
    assert r["peak_rss_mb"]["edge"] > 0.9 * r["model_bytes"] / 1e6
    assert 0 < r["load_to_first_token_s"]["edge"] < r["process_first_token_wall_s"]["edge"]


def test_ceilings_and_fractions(bench_json, gemma_path):
    """The machine's ceilings and each test's fraction of its roofline: pp over the int8 rate,
    tg and batched the larger of weight bytes per step over the read bandwidth and multiply-adds
    over the int8 rate."""
    c = bench_json["ceilings"]
    assert c["kernel_path"] in ("avx512-vnni", "avx512", "avx-vnni", "avx2", "generic")
    assert 1 < c["read_gb_s"] < 10_000 and 1 < c["int8_gmacs"] < 1e6
    gf = GGUFFile(gemma_path)
    # gemma ties output to token_embd: every matrix of the file is read once per token
    mats = [t for t in gf.tensors.values() if len(t.shape) == 2]
    assert c["weight_bytes_per_token"] == sum(int(t.n_bytes) for t in mats)
    assert c["macs_per_token"] == sum(int(t.shape[0]) * int(t.shape[1]) for t in mats)
    embd = gf.tensors["token_embd.weight"].shape
    assert c["macs_per_prompt_token"] == c["macs_per_token"] - int(embd[0]) * int(embd[1])
    for row in bench_json["tests"]:
        e = row["edge"]
        want = e["tps"] * c["macs_per_prompt_token" if row["kind"] == "pp" else "macs_per_token"] / (c["int8_gmacs"] * 1e9)
        if row["kind"] != "pp":
            want = max(want, e["tps"] / row["n_seq"] * c["weight_bytes_per_token"] / (c["read_gb_s"] * 1e9))
        assert e["ceiling_fraction"] == pytest.approx(want, rel=1e-12) and 0 < want < 2, row["test"]


def test_ceiling_kernels():
    """The calibrated loops: the read loop ORs every byte it reads (a byte set anywhere shows),
    and the int8 loop's count of multiply-adds follows the CPU's path."""
    from kernels_cpu import ceilings

    buf = np.zeros(3 * ceilings.CHUNK, np.uint8)
    buf[2 * ceilings.CHUNK + 12345] = 0x40
    out = np.zeros(3, np.uint64)
    ceilings._read_all(buf, out)
    assert out.tolist() == [0, 0, 0x40 << (8 * (12345 % 8))]
    assert ceilings.MACS_PER_STEP == {"avx512-vnni": 512, "avx512": 256, "avx-vnni": 256, "avx2": 256, "generic": 128,
                                      "neon": 128, "neon-dotprod": 128,
                                      "neon-i8mm": 128}[ceilings.kernel_path()]
    assert 1e6 < ceilings.int8_throughput(1, seconds=0.01, repeats=5) < 1e13   # a rate, not a speed test (a loaded machine)


def test_llama_cpp_missing_is_reported(bench_json):
    lc = bench_json["llama_cpp"]
    assert lc["python"] == sys.executable
    if HAS_LLAMA_CPP:
        pytest.skip("this interpreter has llama-cpp-python")
    assert "cannot import llama_cpp" in lc["error"]
    assert all(row["llama_cpp"] is None and row["edge_over_llama_cpp"] is None and row["tokens_equal"] is None
               for row in bench_json["tests"])


def test_runner_tokens_are_greedy(gemma_path):
    """tg's N timed forward passes give edge's greedy continuation after the first token (the
    prefill's); batched produces B x N valid token ids."""
    from edge.sampling import SamplingParams

    runner = EdgeRunner(BenchConfig(model=gemma_path))
    ids = runner.engine.raw_prompt(FIRST_PROMPT)
    want = list(runner.engine.generate(ids, SamplingParams(temperature=0.0), N + 1))
    assert runner.tg(ids, N)["tokens"] == want[1:]
    out = runner.batched([ids[:3], ids, ids[:4]], N, 256)["tokens"]
    assert np.asarray(out).shape == (3, N)
    assert out[1] == want[1:]
    assert runner.model.batch_invariant is False              # batched ran batch-invariant, then back


def test_batch_invariant_runner(gemma_path):
    """--batch-invariant: pp and tg in the mode edge serve computes in, which batched keeps; a
    sequence batched with others decodes its alone tokens."""
    runner = EdgeRunner(BenchConfig(model=gemma_path, batch_invariant=True))
    assert runner.model.batch_invariant
    ids = runner.engine.raw_prompt(FIRST_PROMPT)
    alone = runner.tg(ids, N)["tokens"]
    assert runner.batched([ids[:3], ids], N, 256)["tokens"][1] == alone
    assert runner.model.batch_invariant


def test_spec_rows_copy_with_prompt_lookup(gemma_path):
    """--spec: tgN copy plain and with prompt lookup give the same N tokens (run_bench checks it
    too); the copy prompt makes most drafts stick; llama.cpp's side has no such row."""
    from edge.bench import _Bench, _run_tests, copy_prompt

    cfg = BenchConfig(model=gemma_path, n_prompt=0, n_gen=24, batch_sizes=(1,), reps=1, spec=True)
    runner = EdgeRunner(cfg)
    result = {"tests": [], "peak_rss_mb": {}, "llama_cpp": None}
    _run_tests(cfg, _Bench(cfg, {"edge": runner, "llama_cpp": None}, result, lambda m: None), runner)
    rows = {r["test"]: r for r in result["tests"]}
    spec = rows["tg24 copy ngram"]
    assert rows["tg24 copy"]["kind"] == spec["kind"] == "spec" and spec["llama_cpp"] is None
    assert spec["edge"]["n_tokens"] == 24 and spec["edge"]["accepted"] > 12 and spec["edge"]["vs_plain"] > 0
    ids = copy_prompt(runner.engine, 24)
    assert len(ids) > 500 and runner.copy(ids, 5, True)["tokens"] == runner.copy(ids, 5, False)["tokens"]


@pytest.mark.parametrize("opt, value, message", [
    ("-B", "0", "-B/--batched: must be at least 1, got 0"),
    ("-B", "1,,2", "-B/--batched: not an integer: ''"),
    ("-p", "-1", "-p/--n-prompt: must be at least 0, got -1"),
    ("-n", "-1", "-n/--n-gen: must be at least 0, got -1"),
    ("-r", "0", "-r/--repetitions: must be at least 1, got 0"),
])
def test_bad_option_is_usage_error(opt, value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", opt, value])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_zero_skips_a_test_as_llama_bench(gemma_path, capsys):
    """-p 0 runs no prefill test and -n 0 no decode tests (llama-bench's rule); both 0 is an error."""
    for opts, tests in ((["-p", "0", "-n", "2"], ["tg2", "tg2 x1"]), (["-p", "8", "-n", "0"], ["pp8"])):
        assert main(["bench", "-m", str(gemma_path), *opts, "-r", "1", "-B", "1", "--json"]) == 0
        assert [t["test"] for t in json.loads(capsys.readouterr().out)["tests"]] == tests
    assert main(["bench", "-m", str(gemma_path), "-p", "0", "-n", "0"]) == 1
    assert "edge bench: error: -p 0 and -n 0 leave no test to run" in capsys.readouterr().err


def test_prompt_larger_than_context(gemma_path, capsys):
    assert main(["bench", "-m", str(gemma_path), "-c", "64", "-p", "128"]) == 1
    assert "edge bench: error: -p 128 does not fit the context size -c 64" in capsys.readouterr().err


def test_batch_larger_than_n_batch(gemma_path, capsys):
    """-B above -b is refused before any test runs (a step of B sequences is one batch)."""
    assert main(["bench", "-m", str(gemma_path), "-b", "4", "-B", "1,5", "-p", "0", "-n", "2"]) == 1
    err = capsys.readouterr().err
    assert "edge bench: error: -B 5 exceeds -b/--batch-size 4" in err and "tokens/s" not in err


def _bench_table():
    spec = importlib.util.spec_from_file_location("bench_table", Path(__file__).parents[1] / "tools" / "bench_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_table_markdown_and_readme_markers(bench_json):
    bt = _bench_table()
    md = bt.markdown([bench_json])
    rows = [line for line in md.splitlines() if line.startswith("| gemma-3-270m | ")]
    assert [row.split(" | ")[1] for row in rows[:4]] == [f"pp{P}", f"tg{N}"] + [f"tg{N} x{b}" for b in BATCHED]
    assert f"{bench_json['tests'][0]['edge']['tps']:.1f} ±" in rows[0]
    assert len(rows) == 5  # four tests, one memory and start-up row
    readme = f"intro\n{bt.START}\nold table\n{bt.END}\nrest\n"
    assert bt.replace_between_markers(readme, md) == f"intro\n{bt.START}\n{md}{bt.END}\nrest\n"
    with pytest.raises(ValueError, match="needs the markers"):
        bt.replace_between_markers(f"{bt.END}\n{bt.START}\n", md)
    assert bt.START in (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")


def test_rich_tables(bench_json):
    from rich.console import Console

    from edge.cli.bench import print_result

    console = Console(file=io.StringIO(), width=200)
    print_result(bench_json, console)
    text = console.file.getvalue()
    for row in bench_json["tests"]:
        assert f"│ {row['test']} " in text
        assert f"{row['edge']['tps']:.1f}" in text
    assert f"{bench_json['peak_rss_mb']['edge']:.0f}" in text
    assert f"memory read {bench_json['ceilings']['read_gb_s']:.1f} GB/s" in text
    assert f"{bench_json['tests'][0]['edge']['ceiling_fraction']:.0%}" in text
    k = bench_json["kernels"]
    assert f"kernel path {k['path']} on {k['cpu']}" in " ".join(text.split())   # the title names the kernel path
    first, n = next(iter(bench_json["tensor_types"].items()))
    assert f"({first}×{n}, " in text.replace("\n", "")   # the model's tensor types in the title
    if not HAS_LLAMA_CPP:
        assert "pip install -e '.[bench]'" in text.replace("\n", " ")   # not eaten as rich markup


@pytest.mark.parametrize("argv, message", [
    (["run", "--temp", "-1", "hi"], "edge run: error: --temp must be >= 0, got -1.0"),
    (["run", "--min-p", "2", "hi"], "edge run: error: --min-p must be in [0, 1], got 2.0"),
    (["run", "--repeat-last-n", "-5", "hi"], "edge run: error: --repeat-last-n must be >= -1"),
    (["perplexity", "-c", "7", "-f", "x.txt"], "edge perplexity: error: -c/--ctx-size must be an even number >= 4"),
    (["perplexity", "-f", "/nonexistent/ppl.txt"], "edge perplexity: error: /nonexistent/ppl.txt: No such file or directory"),
])
def test_cli_errors_name_the_flag(argv, message, capsys):
    """Errors found before any model is loaded name the flag (or file) the user typed."""
    assert main(argv) == 1
    assert message in capsys.readouterr().err


def test_reps_take_turns_and_a_llama_failure_leaves_edge_measured():
    """The timed repetitions alternate between the runners (edge, llama.cpp, edge, ...), after
    one warm-up each; a llama.cpp runner failing mid-test leaves edge's row and a null llama.cpp."""
    from edge.bench import _Bench

    calls = []

    class Runner:
        def __init__(self, name, fail_at=None):
            self.name, self.fail_at, self.n = name, fail_at, 0

        def run(self):
            self.n += 1
            calls.append(self.name)
            if self.n == self.fail_at:
                raise RuntimeError("gone")
            return {"s": 0.5, "n_tokens": 10}

    cfg = BenchConfig(model="m", reps=3)
    result = {"tests": [], "llama_cpp": {"error": None}}
    b = _Bench(cfg, {"edge": Runner("edge"), "llama_cpp": Runner("llama")}, result, lambda msg: None)
    row = b.measure("tg4", "tg", 1, 4, lambda r: r.run(), lambda r: r.run())
    assert calls == ["edge", "llama", "edge", "llama", "edge", "llama", "edge", "llama"]
    assert row["edge"]["samples"] == [20.0] * 3 and row["llama_cpp"]["samples"] == [20.0] * 3
    assert row["edge_over_llama_cpp"] == 1.0
    calls.clear()
    b = _Bench(cfg, {"edge": Runner("edge"), "llama_cpp": Runner("llama", fail_at=3)}, result, lambda msg: None)
    row = b.measure("tg4", "tg", 1, 4, lambda r: r.run(), lambda r: r.run())
    assert calls == ["edge", "llama", "edge", "llama", "edge", "llama", "edge"]
    assert row["edge"]["samples"] == [20.0] * 3 and row["llama_cpp"] is None
    assert result["llama_cpp"]["error"] == "tg4: gone"


def test_llama_python_alone_asks_for_the_comparison(monkeypatch, gemma_path):
    """--llama-python without --vs-llama-cpp ran edge alone, the interpreter silently ignored;
    it now implies the comparison (and --vs-llama-cpp alone uses this interpreter)."""
    import edge.bench
    import edge.cli.bench as cli_bench

    seen = []
    monkeypatch.setattr(cli_bench, "_compile_first", lambda cfg: None)
    monkeypatch.setattr(cli_bench, "print_result", lambda result: None)
    monkeypatch.setattr(edge.bench, "run_bench", lambda cfg: seen.append(cfg.llama_python) or {})
    for extra, want in ((["--llama-python", "/opt/py/bin/python"], "/opt/py/bin/python"),
                        (["--vs-llama-cpp"], sys.executable), ([], None)):
        assert main(["bench", "-m", str(gemma_path), "-t", "1", *extra]) == 0
        assert seen[-1] == want
