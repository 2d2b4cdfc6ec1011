"""Shared fixtures. Tests that need a real model use the real file, pulled through the model
store on first use (`edge pull`), exactly as a user gets it."""
from __future__ import annotations

import json
import os
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
