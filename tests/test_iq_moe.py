"""An MoE model with I-quant experts against llama.cpp: qwen3moe-iq4_xs, tools/make_iq_moe_fixture.py's
tiny qwen3moe (1 layer, 4 experts of 256, 2 used) quantized by llama-quantize to IQ4_XS (every
attention, expert and output matrix; token_embd Q8_0; router F32). The GGUF is committed
(tests/data/arch/iq/qwen3moe-iq4_xs.gguf) and must be the one the fixture came from (sha256); the
fixture tests/data/arch/qwen3moe-iq4_xs.npz holds llama.cpp 0.3.36's logits and greedy tokens. No
oracle at test time. The checks are tests/test_arch_llama_cpp.py's: prompt logits (within
TOLERANCE of the largest logit, argmax where llama.cpp's top-2 are TIE_GAP apart, MIN_EXACT_ROWS
of the rows to the bit, since edge's IQ4_XS matmul is to be ggml's bit for bit), 32 greedy decode
steps, and the prompt plus greedy tokens in one batch. While edge lacks the type, each test fails
in one line naming it (QuantFormatError), not with a traceback.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from edge.gguf_file import GGUFFile
from edge.models import load_model
from kernels_cpu.dequant import QuantFormatError

DATA = Path(__file__).parent / "data" / "arch"
CASE = "qwen3moe-iq4_xs"
N_CTX = 64
TOLERANCE = 2e-2      # as test_arch_llama_cpp's q4_k: a last-bit router / softmax difference can flip a rounding
MIN_EXACT_ROWS = 0.5
TIE_GAP = 0.05
MAX_PARTINGS = 1


@pytest.fixture(scope="module")
def case():
    """(edge's model, the fixture's arrays); fails in one line if edge cannot run the file's types."""
    path, fixture = DATA / "iq" / f"{CASE}.gguf", DATA / f"{CASE}.npz"
    assert fixture.is_file() and path.is_file(), f"no {fixture} / {path}: make them with tools/make_iq_moe_fixture.py"
    z = dict(np.load(fixture))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == str(z["gguf_sha256"]), \
        f"{path} is not the file the fixture came from: rebuild with tools/make_iq_moe_fixture.py"
    problem = None
    try:
        model = load_model(GGUFFile(path))
        model.forward([0], model.new_cache(N_CTX))
    except QuantFormatError as e:
        problem = str(e)
    if problem:
        pytest.fail(f"{CASE}: edge cannot run it: {problem}", pytrace=False)
    return model, z


def _prompts(z: dict) -> list[int]:
    return sorted(int(k[1:].split("_")[0]) for k in z if k.endswith("_ids"))


def _gap(row: np.ndarray) -> float:
    top2 = np.sort(row)[-2:]
    return float(top2[1] - top2[0])


def _check_close(got: np.ndarray, ref: np.ndarray, what: str) -> float:
    """Assert got (f32[n, n_vocab]) within TOLERANCE of ref with its argmax off near-ties; returns the error."""
    err = float(np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max())
    assert err <= TOLERANCE, f"{CASE} {what}: max error {err:.2e} of the largest logit"
    for i, (g, r) in enumerate(zip(got, ref)):
        if _gap(r) >= TIE_GAP:
            assert int(np.argmax(g)) == int(np.argmax(r)), f"{CASE} {what} row {i}: argmax {np.argmax(g)}, " \
                                                           f"llama.cpp {np.argmax(r)} (gap {_gap(r):.3f})"
    return err


def test_prompt_logits(case):
    model, z = case
    exact = rows = 0
    for k in _prompts(z):
        ids = z[f"p{k}_ids"]
        got = model.forward(ids, model.new_cache(N_CTX), slice(None))
        err = _check_close(got, z[f"p{k}_logits"], f"prompt {k}")
        exact += int((got == z[f"p{k}_logits"]).all(axis=1).sum())
        rows += len(ids)
        print(f"{CASE} prompt {k}: max error {err:.2e}")
    print(f"{CASE}: {exact}/{rows} prompt rows bit-equal")
    assert exact >= MIN_EXACT_ROWS * rows, f"{CASE}: only {exact} of {rows} rows equal llama.cpp's"


def test_greedy_and_decode_logits(case):
    model, z = case
    partings = []
    for k in _prompts(z):
        greedy, ref = z[f"p{k}_greedy"], z[f"p{k}_greedy_logits"]
        cache = model.new_cache(N_CTX)
        rows = [model.forward(z[f"p{k}_ids"], cache)[0]]
        for t in greedy[:-1]:
            rows.append(model.forward([int(t)], cache)[0])
        rows = np.stack(rows)
        _check_close(rows, ref, f"prompt {k} decode")
        mine = rows.argmax(1)
        if not np.array_equal(mine, greedy):
            i = int(np.argmax(mine != greedy))
            assert _gap(ref[i]) < TIE_GAP, f"{CASE} prompt {k}: greedy token {i} is {mine[i]}, llama.cpp {greedy[i]}"
            partings.append((k, i, _gap(ref[i])))
    print(f"{CASE}: greedy parts at near-ties (prompt, step, gap): {partings}")
    assert len(partings) <= MAX_PARTINGS, f"{CASE}: {len(partings)} prompts part from llama.cpp: {partings}"


def test_prefill_gives_the_decode_steps(case):
    model, z = case
    for k in _prompts(z):
        ids, greedy, ref = z[f"p{k}_ids"], z[f"p{k}_greedy"], z[f"p{k}_greedy_logits"]
        got = model.forward(np.r_[ids, greedy[:-1]], model.new_cache(N_CTX), slice(None))[len(ids) - 1:]
        _check_close(got, ref, f"prompt {k} in one batch")
