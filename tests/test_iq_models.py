"""The I-quant, ternary and MXFP4 weight types against llama.cpp on tiny random-weight models
(tests/iq_cases.py): one llama3 layer whose attention, FFN and output matrices are llama-quantize's
IQ4_XS, IQ4_NL, IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M, TQ2_0, TQ1_0 or MXFP4
(with an imatrix; token_embd Q8_0). The GGUFs are committed (tests/data/arch/iq/, made by
tools/make_iq_fixtures.py, which needs llama.cpp) and must be the files the fixtures
(tests/data/arch/<case>.npz, llama.cpp 0.3.36's logits and greedy tokens) came from (sha256). No
oracle is needed at test time.

The checks are tests/test_arch_llama_cpp.py's test functions, imported (its TOLERANCE, Q8_0's
bound, TIE_GAP, MAX_PARTINGS, MIN_EXACT_ROWS): prompt logits of every position within TOLERANCE of
llama.cpp's and, edge's matmuls being llama.cpp's bit for bit, at least MIN_EXACT_ROWS of the rows
equal to the bit; 32 greedy decode steps (tokens equal until a near-tie); the prompt and greedy tokens in one batch give the decode
steps' logits. A type edge has no kernel for fails in one line naming it.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from edge.gguf_file import GGUFFile
from edge.models import load_model
from tests.iq_cases import IQ_CASES

# the three comparisons, run here on this module's `case` fixture (tolerance: that module's
# TOLERANCE["iq4_xs"] etc.)
from tests.test_arch_llama_cpp import (  # noqa: F401
    N_CTX,
    test_greedy_and_decode_logits,
    test_prefill_gives_the_decode_steps,
    test_prompt_logits,
)

FIXTURES = Path(__file__).parent / "data" / "arch"


@pytest.fixture(scope="module", params=list(IQ_CASES))
def case(request):
    """(case name, edge's model, the fixture's arrays) of one case; fails in one line when edge
    refuses the case's weight type."""
    name = request.param
    fixture, path = FIXTURES / f"{name}.npz", FIXTURES / "iq" / f"{name}.gguf"
    assert fixture.is_file() and path.is_file(), f"no {fixture} / {path}: make them with " \
                                                  f"tools/make_iq_fixtures.py {name}"
    z = dict(np.load(fixture))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == str(z["gguf_sha256"]), \
        f"{name}: {path} is not the file the fixture came from: rebuild with tools/make_iq_fixtures.py {name}"
    model = load_model(GGUFFile(path))
    refused = None
    try:
        model.forward([1], model.new_cache(N_CTX))
    except ValueError as e:   # kernels_cpu.dequant.QuantFormatError: a type without kernels
        refused = f"{name}: edge cannot run {IQ_CASES[name]} weights: {e}"
    if refused:
        pytest.fail(refused, pytrace=False)
    return name, model, z


def test_the_cases_cover_every_new_type():
    """Each type of issue 17 has a case, and each case's file holds its matrices in that type."""
    assert sorted(IQ_CASES.values()) == sorted(["IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS",
                                                "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4"])
    for name, t in IQ_CASES.items():
        types = [info.ggml_type.name for info in GGUFFile(FIXTURES / "iq" / f"{name}.gguf").tensors.values()]
        assert types.count(t) == 8 and types.count("Q8_0") == 1, f"{name}: {types}"
