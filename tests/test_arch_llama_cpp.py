"""Each architecture against llama.cpp on tiny random-weight models (tests/arch_cases.py), in
F16, Q8_0 and a K-quant mix. The fixtures (tests/data/arch/<case>.npz) hold llama.cpp 0.3.36's
logits and greedy tokens (tools/make_arch_fixtures.py); the GGUFs are rebuilt here and must be
the files the fixtures came from (sha256). No oracle is needed at test time.

Per case and prompt (three prompts of 5, 11 and 17 tokens):
- prompt logits: edge's one-batch prefill, every position, within TOLERANCE[weight type] of
  llama.cpp's (max |difference| over max |logit|); edge's argmax is llama.cpp's wherever
  llama.cpp's top-2 are at least TIE_GAP apart; with quantized weights (whose matmuls edge
  reproduces bit for bit) at least MIN_EXACT_ROWS of the rows are llama.cpp's to the bit, so a
  systematic slip (an epsilon, an op order) fails even where it is small;
- greedy: 32 decode steps fed llama.cpp's greedy tokens; each step's logits within the same
  tolerance, and edge's greedy token equals llama.cpp's until they part, which is allowed
  only where llama.cpp's top-2 logits were within TIE_GAP (counted: at most MAX_PARTINGS of a
  case's prompts may part; every parting is printed);
- prefill vs decode: the prompt and the greedy tokens in one batch give the decode steps'
  logits, within the tolerance of llama.cpp's (edge's batched kernels against llama.cpp's
  one-row decode).
Also: every registered architecture but NOT_COMPARED_HERE has its three cases, and an unknown
one is refused in one line naming the known ones.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import pytest

from edge.gguf_file import GGUFFile
from edge.models import ARCHITECTURES, UnsupportedArchitecture, load_model
from tests.arch_cases import ARCH_CASES, WEIGHT_TYPES
from tests.iq_cases import IQ_CASES
from tests.tiny_models import write_tiny_model

FIXTURES = Path(__file__).parent / "data" / "arch"
N_CTX = 64
# max |edge - llama.cpp| / max |llama.cpp logit| per weight type. Random tiny models amplify a
# last-bit difference (llama.cpp on this CPU sums f16/f32 dot products in another order than
# edge, and an 8-bit activation rounding can flip); a wrong op moves logits by far more.
TOLERANCE = {"f16": 5e-3, "q8_0": 3e-2, "q4_k": 2e-2}
# tests/test_iq_models.py's cases (llama3-iq4_xs, ...: their matmuls too are llama.cpp's bit for
# bit): Q8_0's bound
TOLERANCE.update({t.lower(): TOLERANCE["q8_0"] for t in IQ_CASES.values()})
# measured (llama.cpp's AVX2 build, edge's AVX-512 order): F16 at most 2.0e-3 (edge's F16 matmul
# sums in another order, never bit-equal); Q8_0 1.9e-2 and Q4_K 6.2e-3, from a few rows that
# part after a last-bit difference (softmax block sums, the F32 router) flips an 8-bit rounding
MIN_EXACT_ROWS = 0.5  # quantized cases: this share of prompt rows bit-equal (measured >= 27/33)
TIE_GAP = 0.05        # llama.cpp's top-2 logits closer than this: either token may be greedy's
MAX_PARTINGS = 1      # of a case's 3 prompts, at most this many may part (at a near-tie)


# registered architectures without tiny cases here: those edge had before these comparisons
# (qwen2 and gemma3 are held to llama.cpp by the real-model goldens, tests/test_golden.py)
NOT_COMPARED_HERE = {"llama", "qwen2", "gemma3"}


def test_every_architecture_has_its_three_cases():
    """A registered architecture is compared with llama.cpp in every weight type."""
    have = {(kw["arch"], name.rsplit("-", 1)[1]) for name, kw in ARCH_CASES.items()}
    for arch in sorted(set(ARCHITECTURES) - NOT_COMPARED_HERE):
        for wt in WEIGHT_TYPES:
            assert (arch, wt) in have, f"{arch} has no {wt} case in tests/arch_cases.py"


def test_unknown_architecture_names_the_known_ones(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", arch="mamba")
    known = ", ".join(sorted(ARCHITECTURES))
    with pytest.raises(UnsupportedArchitecture, match=re.escape(f"architecture 'mamba' is not supported "
                                                                f"(supported: {known})") + "$"):
        load_model(GGUFFile(path))
    assert {"qwen3", "qwen3moe", "olmo2", "smollm3"} <= set(ARCHITECTURES)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module", params=sorted(ARCH_CASES))
def case(request, tmp_path_factory):
    """(case name, edge's model, the fixture's arrays) of one case."""
    name = request.param
    fixture = FIXTURES / f"{name}.npz"
    assert fixture.is_file(), f"no fixture {fixture}: make it with tools/make_arch_fixtures.py {name}"
    z = dict(np.load(fixture))
    path = write_tiny_model(tmp_path_factory.mktemp("arch") / f"{name}.gguf", **ARCH_CASES[name])
    assert _sha256(path) == str(z["gguf_sha256"]), \
        f"{name}: the model file differs from the one the fixture came from: rebuild with " \
        f"tools/make_arch_fixtures.py {name}"
    return name, load_model(GGUFFile(path)), z


def _prompts(z: dict) -> list[int]:
    return sorted(int(k[1:].split("_")[0]) for k in z if k.endswith("_ids"))


def _gap(row: np.ndarray) -> float:
    """llama.cpp's top-1 minus top-2 logit."""
    top2 = np.sort(row)[-2:]
    return float(top2[1] - top2[0])


def _check_close(name: str, got: np.ndarray, ref: np.ndarray, what: str) -> float:
    """Assert got is within the case's tolerance of ref (f32[n, n_vocab]) and has its argmax
    wherever ref's top-2 are TIE_GAP apart; returns the relative max error."""
    err = float(np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max())
    assert err <= TOLERANCE[name.rsplit("-", 1)[1]], f"{name} {what}: max error {err:.2e} of the largest logit"
    for i, (g, r) in enumerate(zip(got, ref)):
        if _gap(r) >= TIE_GAP:
            assert int(np.argmax(g)) == int(np.argmax(r)), f"{name} {what} row {i}: argmax {np.argmax(g)}, " \
                                                           f"llama.cpp {np.argmax(r)} (gap {_gap(r):.3f})"
    return err


def test_prompt_logits(case):
    name, model, z = case
    errs, exact, rows = [], 0, 0
    for k in _prompts(z):
        ids = z[f"p{k}_ids"]
        got = model.forward(ids, model.new_cache(N_CTX), slice(None))
        errs.append(_check_close(name, got, z[f"p{k}_logits"], f"prompt {k}"))
        exact += int((got == z[f"p{k}_logits"]).all(axis=1).sum())
        rows += len(ids)
    print(f"{name}: prompt logits max error {max(errs):.2e}, {exact}/{rows} rows bit-equal")
    if not name.endswith("-f16"):
        assert exact >= MIN_EXACT_ROWS * rows, f"{name}: only {exact} of {rows} rows equal llama.cpp's"


def test_greedy_and_decode_logits(case):
    name, model, z = case
    partings, errs = [], []
    for k in _prompts(z):
        greedy, ref = z[f"p{k}_greedy"], z[f"p{k}_greedy_logits"]
        cache = model.new_cache(N_CTX)
        rows = [model.forward(z[f"p{k}_ids"], cache)[0]]
        for t in greedy[:-1]:                         # llama.cpp's tokens (the same as edge's until they part)
            rows.append(model.forward([int(t)], cache)[0])
        rows = np.stack(rows)
        errs.append(_check_close(name, rows, ref, f"prompt {k} decode"))
        mine = rows.argmax(1)
        if not np.array_equal(mine, greedy):
            i = int(np.argmax(mine != greedy))
            assert _gap(ref[i]) < TIE_GAP, f"{name} prompt {k}: greedy token {i} is {mine[i]}, llama.cpp " \
                                           f"{greedy[i]} (its top-2 gap {_gap(ref[i]):.3f})"
            partings.append((k, i, _gap(ref[i])))
    print(f"{name}: decode logits max error {max(errs):.2e}; greedy parts at near-ties (prompt, step, gap): "
          f"{partings}")
    assert len(partings) <= MAX_PARTINGS, f"{name}: {len(partings)} prompts part from llama.cpp: {partings}"


def test_prefill_gives_the_decode_steps(case):
    """The prompt and llama.cpp's greedy tokens in one batch: the rows after the prompt are the
    decode steps' logits (llama.cpp's, computed one row at a time)."""
    name, model, z = case
    for k in _prompts(z):
        ids, greedy, ref = z[f"p{k}_ids"], z[f"p{k}_greedy"], z[f"p{k}_greedy_logits"]
        got = model.forward(np.r_[ids, greedy[:-1]], model.new_cache(N_CTX), slice(None))[len(ids) - 1:]
        _check_close(name, got, ref, f"prompt {k} in one batch")
