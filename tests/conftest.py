"""Shared fixtures. Tests that need a real model use the real file, pulled through the model
store on first use (`edge pull`), exactly as a user gets it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"

# golden id -> registry name
MODELS = {"qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct", "gemma3-270m": "gemma-3-270m"}


def real_model_path(golden_id: str) -> Path:
    from edge.store import resolve_model

    return resolve_model(MODELS[golden_id])


def golden(golden_id: str, name: str):
    path = GOLDEN / golden_id / name
    if not path.exists():
        pytest.skip(f"golden file {path} is missing (../shared is read-only material beside the project)")
    if name.endswith(".json"):
        return json.loads(path.read_text(encoding="utf-8"))
    return path


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    return real_model_path("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    return real_model_path("gemma3-270m")
