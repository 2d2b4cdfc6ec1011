"""Shared fixtures. Tests that need a real model use the real file, pulled through the model
store on first use (`edge pull`), exactly as a user gets it."""
from __future__ import annotations

import hashlib
import json
import os
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

# golden id -> registry name
MODELS = {"qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct", "gemma3-270m": "gemma-3-270m"}


def real_model_path(golden_id: str) -> Path:
    from edge.store import resolve_model

    return resolve_model(MODELS[golden_id])


def golden(golden_id: str, name: str):
    path = GOLDEN / golden_id / name
    if name.endswith(".json"):
        return json.loads(path.read_text(encoding="utf-8"))
    return path


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    return real_model_path("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    return real_model_path("gemma3-270m")


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
    from edge.store import edge_home

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
