"""Shared fixtures. Tests that need a real model use the real file, pulled through the model
store on first use (`edge pull`), exactly as a user gets it."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# llama.cpp's reference outputs: ../shared/golden beside the project, or $EDGE_GOLDEN_DIR
GOLDEN = Path(os.environ.get("EDGE_GOLDEN_DIR") or Path(__file__).resolve().parents[2] / "shared" / "golden")


def pytest_sessionstart(session):
    """Without the goldens most tests against llama.cpp would skip and the run would look
    green; refuse to run instead."""
    if not (GOLDEN / "qwen2.5-coder-0.5b" / "tokenize.json").is_file():
        pytest.exit(f"golden outputs of llama.cpp not found at {GOLDEN}: the tests expect the read-only "
                    "../shared folder beside the project (or set EDGE_GOLDEN_DIR)", returncode=4)

# llama.cpp itself, as the oracle: an interpreter with llama-cpp-python 0.3.36 built from source
# (the build the goldens came from), with llama.cpp's tools (llama-quantize, llama-imatrix,
# llama-perplexity) in the same bin folder. tools/build_oracle.sh builds it once; EDGE_ORACLE_PYTHON
# names it (default: where that script puts it). Without it the oracle tests skip, saying so;
# with EDGE_REQUIRE_ORACLE=1 (.ci/run sets both) they fail instead, so CI never passes without them.
ORACLE_VERSION = "0.3.36"
ORACLE_PYTHON = Path(os.environ.get("EDGE_ORACLE_PYTHON") or
                     Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                     / "edge-oracle" / f"llama-cpp-python-{ORACLE_VERSION}" / "venv" / "bin" / "python")
ORACLE_FIXTURES = ("oracle_python", "llama_cpp_tools")


def _need_oracle(*tools: str) -> Path:
    """The oracle interpreter (checked to import llama_cpp once), or a skip -- a failure under
    EDGE_REQUIRE_ORACLE=1 -- that says what is missing and how to build it."""
    missing = [t for t in tools if not (ORACLE_PYTHON.parent / t).is_file()]
    problem = None
    if not ORACLE_PYTHON.is_file():
        problem = f"no oracle interpreter at {ORACLE_PYTHON}"
    elif missing:
        problem = f"{', '.join(missing)} not found beside {ORACLE_PYTHON}"
    else:
        if _need_oracle.version is None:
            proc = subprocess.run([str(ORACLE_PYTHON), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                                  capture_output=True, text=True, timeout=120)
            _need_oracle.version = proc.stdout.strip() if proc.returncode == 0 else f"error: {proc.stderr[-300:]}"
        if _need_oracle.version != ORACLE_VERSION:
            problem = f"{ORACLE_PYTHON} has llama_cpp {_need_oracle.version!r}, not {ORACLE_VERSION}"
    if problem is None:
        return ORACLE_PYTHON
    msg = f"llama.cpp oracle: {problem} (build it with tools/build_oracle.sh, or set EDGE_ORACLE_PYTHON)"
    if os.environ.get("EDGE_REQUIRE_ORACLE") == "1":
        pytest.fail(msg + "; EDGE_REQUIRE_ORACLE=1 makes this a failure", pytrace=False)
    pytest.skip(msg)


_need_oracle.version = None


@pytest.fixture(scope="session")
def oracle_python() -> Path:
    """The interpreter with llama-cpp-python 0.3.36 (skips or fails without it, see above)."""
    return _need_oracle()


@pytest.fixture(scope="session")
def llama_cpp_tools() -> Path:
    """The folder of llama.cpp's llama-quantize, llama-imatrix and llama-perplexity."""
    return _need_oracle("llama-quantize", "llama-imatrix", "llama-perplexity").parent


# Files whose tests share the session's GemmaQuantLab: under pytest-xdist they run in one worker,
# so its quantizations, importance matrix and KLD base are made once.
QUANT_LAB_FIXTURES = ("gemma_f16_path", "gemma_quant_lab")


def pytest_collection_modifyitems(config, items):
    """Tests that use the oracle carry the ``oracle`` marker (``-m oracle`` runs just them).
    Every test gets an ``xdist_group``: its file's name, or "gemma-quant" for the files that use
    the quantization fixtures, so ``-n N --dist loadgroup`` keeps each file's module fixtures (a
    loaded model, compiled kernels) in one worker."""
    lab_files = {item.path for item in items
                 if any(f in getattr(item, "fixturenames", ()) for f in QUANT_LAB_FIXTURES)}
    for item in items:
        if any(f in getattr(item, "fixturenames", ()) for f in ORACLE_FIXTURES):
            item.add_marker(pytest.mark.oracle)
        item.add_marker(pytest.mark.xdist_group("gemma-quant" if item.path in lab_files else item.path.stem))
    # the longest group first: a worker takes it at once rather than as the run's last straggler
    items.sort(key=lambda item: item.path not in lab_files)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line counting the oracle tests by outcome, so a log shows they ran."""
    counts: dict[str, int] = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for rep in terminalreporter.stats.get(outcome, []):
            if "oracle" in getattr(rep, "keywords", {}) and (rep.when == "call" or outcome != "passed"):
                counts[outcome] = counts.get(outcome, 0) + 1
    if counts:
        shown = ", ".join(f"{n} {k}" for k, n in counts.items())
        terminalreporter.write_line(f"llama.cpp oracle tests ({ORACLE_PYTHON}): {shown}")


# golden id -> registry name
MODELS = {"qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct", "gemma3-270m": "gemma-3-270m",
          "smollm2-135m": "smollm2-135m-instruct"}


def real_model_path(golden_id: str) -> Path:
    from edge.store import resolve_model

    return resolve_model(MODELS[golden_id])


def golden(golden_id: str, name: str):
    path = GOLDEN / golden_id / name
    if name.endswith(".json"):
        return json.loads(path.read_text(encoding="utf-8"))
    return path


_cli_perplexity: dict[tuple[str, ...], tuple[subprocess.CompletedProcess, float]] = {}


def cli_perplexity(golden_id: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """`edge perplexity` of a real model on its perplexity golden's text at the golden's n_ctx,
    with extra CLI ``args``: (the finished process, its "PPL = x" value). Run once per session
    per (model, args): tests/test_golden.py checks it against llama.cpp, tests/test_kv_cache.py
    compares q8_0 K/V with it."""
    key = (golden_id, *args)
    if key not in _cli_perplexity:
        ref = golden(golden_id, "perplexity.json")
        proc = subprocess.run(
            [sys.executable, "-m", "edge.cli", "perplexity", "-m", str(real_model_path(golden_id)),
             "-f", str(GOLDEN / ref["text_file"]), "-c", str(ref["n_ctx"]), *args],
            capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stderr
        m = re.search(r"PPL = ([0-9.]+)", proc.stdout)
        assert m, proc.stdout
        _cli_perplexity[key] = proc, float(m.group(1))
    return _cli_perplexity[key]


def kill_when_printed(argv: list[str], line: str, env: dict | None = None, timeout: float = 120) -> int:
    """Run ``argv``, SIGKILL it as soon as it prints ``line`` (a whole stdout line); returns its
    pid. Fails the test, with its stderr, when it ends first or stays silent ``timeout`` s."""
    import signal
    import threading

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        got = proc.stdout.readline()
    finally:
        timer.cancel()
        proc.kill()
        _, err = proc.communicate()
    assert got == line + "\n" and proc.returncode == -signal.SIGKILL, err
    return proc.pid


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    return real_model_path("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    return real_model_path("gemma3-270m")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return real_model_path("smollm2-135m")


# The F16 source the quantize goldens were made from (quantize.json's source_file_sha256)
GEMMA_F16_SOURCE_SIZE = 542_833_344


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture(scope="session")
def gemma_f16_path(gemma_path) -> Path:
    """gemma-3-270m as the unquantized GGUF the quantize goldens came from (F16 matrices, F32
    vectors), built once by the shared tools/make_f16_source.py (beside the goldens) into
    $EDGE_HOME/test-data; reused while its size and sha256 match quantize.json."""
    from edge.files import edge_home

    want = golden("gemma3-270m", "quantize.json")["source_file_sha256"]
    path = edge_home() / "test-data" / "gemma-3-270m-f16.gguf"
    if path.is_file() and path.stat().st_size == GEMMA_F16_SOURCE_SIZE and _sha256_file(path) == want:
        return path
    tool = GOLDEN.parent / "tools" / "make_f16_source.py"
    if not tool.is_file():
        pytest.skip(f"cannot build the F16 source of the quantize goldens: {tool} not found")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        subprocess.run([sys.executable, str(tool), str(gemma_path), str(tmp)], check=True)
        got = _sha256_file(tmp)
        if tmp.stat().st_size != GEMMA_F16_SOURCE_SIZE or got != want:
            pytest.fail(f"{tool.name} built {tmp.stat().st_size} bytes with sha256 {got}, expected "
                        f"{GEMMA_F16_SOURCE_SIZE} bytes with sha256 {want} (another gguf version?)")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


class GemmaQuantLab:
    """What the quantization tests share, each made once per session on first use (the slow
    parts of tests/test_quantize_file.py, test_kl_divergence.py and test_imatrix.py):

    - quantized(ftype, imatrix=False): path of edge's quantization of the gemma-3-270m F16 source
      (with imatrix, weighted by calib_imatrix());
    - calib_imatrix(): path of the F16 source's importance matrix of calib_text.txt with
      llama-imatrix's defaults (-c 512, all 13 chunks);
    - kld_base(): (PerplexityResult, path) of the F16 source on the perplexity golden's text at
      its n_ctx (256), with the base log-probs saved (llama-perplexity --kl-divergence-base; 0.5 MB
      per scored token);
    - kld(ftype, imatrix=False, max_chunks=-1): KLDivergenceResult of quantized(ftype, imatrix)
      against kld_base() (it also gives the quantization's perplexity on the same tokens), over
      all 13 chunks or the first ``max_chunks`` (the comparisons that do not need them all).
    """

    def __init__(self, f16_path: Path, folder: Path):
        self.f16_path, self.folder = f16_path, folder
        self._done: dict = {}

    def _once(self, key, make):
        if key not in self._done:
            self._done[key] = make()
        return self._done[key]

    def quantized(self, ftype: str, imatrix: bool = False) -> Path:
        def make():
            from edge.imatrix import load_imatrix
            from quant.mix import FILE_TYPES, QuantizeOptions
            from quant.pipeline import quantize_file

            path = self.folder / f"gemma-3-270m-{ftype}{'-imatrix' if imatrix else ''}.gguf"
            weights = load_imatrix(self.calib_imatrix()) if imatrix else None
            quantize_file(self.f16_path, path, FILE_TYPES[ftype], QuantizeOptions(), imatrix=weights)
            return path
        return self._once(("quantized", ftype, imatrix), make)

    def calib_imatrix(self) -> Path:
        def make():
            from edge.engine import Engine
            from edge.imatrix import compute_imatrix, write_imatrix

            path = self.folder / "calib.imatrix.gguf"
            text = (GOLDEN / "calib_text.txt").read_text(encoding="utf-8")
            engine = Engine(self.f16_path, n_ctx=512, n_batch=512)
            write_imatrix(path, compute_imatrix(engine, text, n_ctx=512, dataset="calib_text.txt"))
            return path
        return self._once("imatrix", make)

    def kld_base(self):
        def make():
            from edge.engine import Engine
            from edge.perplexity import perplexity

            ref = golden("gemma3-270m", "perplexity.json")
            n_ctx = int(ref["n_ctx"])
            path = self.folder / "gemma-3-270m-f16.kld"
            text = (GOLDEN / ref["text_file"]).read_text(encoding="utf-8")
            return perplexity(Engine(self.f16_path, n_ctx=n_ctx), text, n_ctx, save_base=path), path
        return self._once("kld_base", make)

    def kld(self, ftype: str, imatrix: bool = False, max_chunks: int = -1):
        def make():
            from edge.engine import Engine
            from edge.kl_divergence import kl_divergence
            from edge.logits_file import BaseLogits

            base = BaseLogits(self.kld_base()[1])
            res = kl_divergence(Engine(self.quantized(ftype, imatrix), n_ctx=base.n_ctx), base, max_chunks)
            s = res.summary()
            print(f"{ftype}{' imatrix' if imatrix else ''} vs F16 ({res.n_chunks} chunks): "
                  f"mean KLD {s['kld'][0]:.6f} ± {s['kld'][1]:.6f}, same top {100 * s['same_top'][0]:.3f} %, PPL {s['ppl'][0]:.4f} (F16 {s['ppl_base'][0]:.4f})")
            return res
        return self._once(("kld", ftype, imatrix, max_chunks), make)


@pytest.fixture(scope="session")
def gemma_quant_lab(gemma_f16_path, tmp_path_factory) -> GemmaQuantLab:
    """The session's GemmaQuantLab (files in a session temporary folder)."""
    return GemmaQuantLab(gemma_f16_path, tmp_path_factory.mktemp("gemma-quant"))
