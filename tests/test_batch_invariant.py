"""Batch-invariant mode (Transformer.set_batch_invariant), which the server runs in: a token's
logits are bit-identical whatever batch or prefill chunking computed it, so a request's text
does not depend on what else is being served. Without it (llama.cpp's kernel choice per batch
size) they differ in the last bits, which these tests also check, so that they can fail."""
import numpy as np
import pytest
from numba import njit

from kernels_cpu.matmul_kernels import _Q5_0, _Q8_0
from kernels_cpu.matmul_tiles import GEMV
from kernels_cpu.matmul_tiling import NR, _tiled

from edge.gguf_file import GGUFFile
from edge.kv.cache import PagedKVCache
from edge.models import load_model
from tests.test_models import CASES
from tests.tiny_models import write_tiny_model

rng = np.random.default_rng(7)
PROMPTS = [list(rng.integers(1, 90, n)) for n in (37, 21, 50, 9)]


@pytest.fixture(scope="module", params=["llama-quant", "llama-quant-2", "qwen2-quant", "gemma3-quant-swa",
                                        "gemma3-f32-swa"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("bi") / f"{request.param}.gguf"
    write_tiny_model(path, **CASES[request.param])
    m = load_model(GGUFFile(path))
    m.set_batch_invariant(True)
    return request.param, m


def _alone(model, prompt, chunks, n_decode, next_tokens):
    """Logits of each prompt chunk's rows and of n_decode decode steps, the sequence alone."""
    cache = PagedKVCache(model.args, 128, 1, 16, storage="anon")
    s, _ = cache.new_sequence(prompt)
    out, i = [], 0
    for n in chunks:
        out.append(model.forward(prompt[i : i + n], cache, slice(None), seq_ids=np.full(n, s)))
        i += n
    for tok in next_tokens[:n_decode]:
        cache.append(s, [tok])
        out.append(model.forward([tok], cache, slice(None), seq_ids=[s]))
    return np.concatenate(out)


def _together(model, prompts, next_tokens):
    """The same logits as _alone for every prompt, all prompts prefilled in one batch and
    each decode step one batch of a row per sequence."""
    cache = PagedKVCache(model.args, 128, len(prompts), 16, storage="anon")
    slots = [cache.new_sequence(p)[0] for p in prompts]
    ids = np.concatenate([np.full(len(p), s) for p, s in zip(prompts, slots)])
    rows = model.forward(np.concatenate(prompts), cache, slice(None), seq_ids=ids)
    got = [[rows[ids == s]] for s in slots]
    for tok in next_tokens:
        for s in slots:
            cache.append(s, [tok])
        step = model.forward([tok] * len(slots), cache, slice(None), seq_ids=slots)
        for i in range(len(slots)):
            got[i].append(step[i : i + 1])
    return [np.concatenate(g) for g in got]


def test_rows_do_not_depend_on_the_batch(model):
    """Four sequences prefilled in one mixed batch (with chunks of other sizes) and decoded
    together give each sequence's logits bit for bit as computed alone, whole or chunked."""
    name, model = model
    nxt = [5, 17, 33, 2, 71, 8]
    alone = [_alone(model, p, [len(p)], len(nxt), nxt) for p in PROMPTS]
    chunked = _alone(model, PROMPTS[0], [3, 16, 1, 17], len(nxt), nxt)
    assert np.array_equal(chunked, alone[0])

    for i, got in enumerate(_together(model, PROMPTS, nxt)):
        assert np.array_equal(got, alone[i]), i

    model.set_batch_invariant(False)    # llama.cpp's kernels: the chunking shows in the last bits
    try:
        whole = _alone(model, PROMPTS[0], [len(PROMPTS[0])], len(nxt), nxt)
        one_by_one = _alone(model, PROMPTS[0], [1] * len(PROMPTS[0]), len(nxt), nxt)
    finally:
        model.set_batch_invariant(True)
    # (llama-quant-2's K-quant rows are one super-block long, where llama.cpp's paths coincide)
    assert np.array_equal(whole, one_by_one) == (name == "llama-quant-2")


def test_real_model_rows_do_not_depend_on_the_batch(qwen_path):
    """The default model (Q4_K repacked, Q6_K, Q5_0, Q8_0 weights): three prompts prefilled
    together in one batch of 27 rows and decoded together give the logits of each alone."""
    from edge.engine import Engine
    m = Engine(qwen_path, n_ctx=128, batch_invariant=True).model     # as edge run --batch-invariant makes it
    assert m.batch_invariant and all(w.batch_invariant for w in m.weights())
    assert not Engine(qwen_path, n_ctx=128).model.batch_invariant    # the default: llama.cpp's kernel choice
    prompts = [[9707, 11, 1879, 0, 358, 1079, 264, 2025, 13], [785, 6722, 315, 9625, 374],
               [750, 38418, 1445, 982, 262, 470, 308, 421, 308, 366, 220, 17, 770, 15801, 1445]]
    nxt = [220, 16, 17]
    alone = [_alone(m, p, [len(p)], len(nxt), nxt) for p in prompts]
    for i, got in enumerate(_together(m, prompts, nxt)):
        assert np.array_equal(got, alone[i]), i


@njit(parallel=True)
def _generic_gemv_q5_0(w, xqs, xd, out):
    _tiled(_Q5_0, GEMV, NR, w, xqs, xd, xd, out)


@njit(parallel=True)
def _generic_gemv_q8_0(w, xqs, xd, out):
    _tiled(_Q8_0, GEMV, NR, w, xqs, xd, xd, out)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q8_0"])
def test_q0_batch_invariant_kernels_are_the_gemv_structure(qtype):
    """The server's Q5_0 / Q8_0 kernels (VNNI tiles, one weight row per lane) give bit for bit
    the generic GEMV tile's results (one fma of each block's exact integer total times
    d_w * d_x, llama.cpp's repacked-q4_0 structure), for any number of rows and tokens, and
    stay within float rounding of the dequantized product."""
    from gguf import GGMLQuantizationType as T

    from kernels_cpu import matmul as M
    from kernels_cpu.dequant import dequantize
    from tests.test_matmul import random_weights

    t = T[qtype]
    generic = _generic_gemv_q5_0 if qtype == "Q5_0" else _generic_gemv_q8_0

    rng = np.random.default_rng(3)
    for R, K, ns in ((5, 64, (1, 3, 4, 9)), (13, 256, (1, 3, 4, 9)), (64, 96, (1, 3, 4, 9)), (40, 96, (2, 70))):
        w = random_weights(t, R, K, rng)   # R >= 16: 16-row panels for n >= 2 (the last overlapping), n > 64: two chunks
        for n in ns:
            x = rng.standard_normal((n, K)).astype(np.float32)
            got = M.matmul(w, t, x, batch_invariant=True)
            xq = M._quantize(t, x, M._allocate)
            want = np.empty((n, R), np.float32)
            generic(w, *xq.arrays, want)
            assert np.array_equal(got, want), (R, K, n)
            exact = x.astype(np.float64) @ dequantize(w, t).reshape(R, K).astype(np.float64).T
            assert np.abs(got - exact).max() <= 0.05 * np.abs(exact).max() + 1e-3


def test_q6_k_batch_invariant_rows_do_not_depend_on_the_batch():
    """Q6_K in batch-invariant mode: one row (with AVX-512 VNNI kernels_cpu.kquant_int8's tiles
    of two rows, which read the weights faster than the 8-row tile at one row) gives the bits the
    same row gets in batches of 2, 7 and 9 rows (the 8-row tiles, 16-row panels)."""
    from gguf import GGMLQuantizationType as T

    from kernels_cpu import matmul as M
    from tests.test_matmul import random_weights

    rng = np.random.default_rng(11)
    for R, K in ((16, 256), (40, 512), (13, 768)):
        w = random_weights(T.Q6_K, R, K, rng)
        x = rng.standard_normal((9, K)).astype(np.float32)
        batches = [M.matmul(w, T.Q6_K, x[:n], batch_invariant=True) for n in (2, 7, 9)]
        for t in range(9):
            alone = M.matmul(w, T.Q6_K, x[t : t + 1], batch_invariant=True)
            for got in batches:
                if t < got.shape[0]:
                    assert np.array_equal(alone[0], got[t]), (R, K, t)
        vec_dot = M.matmul(w, T.Q6_K, x[:1])   # llama.cpp's one-row arithmetic: other last bits
        assert np.allclose(vec_dot, batches[0][:1], rtol=1e-4, atol=1e-3)
