"""The paged KV cache (edge.kv.cache) in the forward pass, on tiny random-weight models of
every architecture: the same logits as the contiguous reference cache for any block size,
chunking and KV type; prefix caching; sliding-window blocks released and reused."""
import os

import numpy as np
import pytest

from edge.gguf_file import GGUFFile
from edge.kv.cache import NoFreeSlot, PagedKVCache, kv_bytes_per_token
from edge.models import load_model
from tests.test_models import CASES, TOKENS
from tests.tiny_models import write_tiny_model

LONG = TOKENS * 5  # 70 tokens: crosses blocks of 16 and 64, and Gemma's windows


@pytest.fixture(scope="module", params=["llama-quant", "qwen2-quant", "gemma3-quant-swa", "gemma3-f32-swa"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf"
    write_tiny_model(path, **CASES[request.param])
    return request.param, load_model(GGUFFile(path))


def _run(model, cache, tokens, chunks, seq=None):
    """All-rows logits of ``tokens`` fed in ``chunks``; paged caches get a sequence first."""
    out, i = [], 0
    if isinstance(cache, PagedKVCache):
        seq, n_cached = cache.new_sequence(tokens[: chunks[0]])
        assert n_cached == 0
    for n in chunks:
        if isinstance(cache, PagedKVCache) and i > 0:
            cache.append(seq, tokens[i : i + n])
        ids = None if seq is None else np.full(n, seq)
        out.append(model.forward(tokens[i : i + n], cache, slice(None), seq_ids=ids))
        i += n
    return np.concatenate(out)


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_paged_equals_contiguous(tiny, block_size, kv_type):
    """Block tables change where K/V live, not the arithmetic: bit-identical logits (the issue
    asks for 1e-4 in f32), whole prefill, chunks that cross block boundaries, and decode."""
    _, model = tiny
    for chunks in ([len(LONG)], [5, 16, 17, 1, 1, 30]):
        ref = _run(model, model.new_cache(128, kv_type=kv_type), LONG, chunks)
        paged = PagedKVCache(model.args, 128, block_size=block_size, type_k=kv_type, type_v=kv_type,
                             storage="anon")
        got = _run(model, paged, LONG, chunks)
        assert np.array_equal(got, ref)


def test_q8_0_kv_close_to_f16(tiny):
    name, model = tiny
    ref = _run(model, model.new_cache(128), LONG, [40, 30])
    paged = PagedKVCache(model.args, 128, type_k="q8_0", type_v="q8_0", storage="anon")
    got = _run(model, paged, LONG, [40, 30])
    err = np.abs(got - ref).max(axis=1) / np.abs(ref).max()
    # 8-bit K/V on random tiny models: a few percent of the logit range (a wrong cell would be
    # of the order of the range itself); the real measure is perplexity (tools/)
    assert np.median(err) < 0.05 and err.max() < 0.3 and (got.argmax(1) == ref.argmax(1)).mean() >= 0.8


def test_prefix_cache_reuses_blocks(tiny):
    """A second sequence with the same first 33 tokens reuses 2 full blocks of 16 (32
    tokens), computes the rest, and gets the logits of a cold run (to the tolerance of other
    chunkings, as test_models); the shared blocks are held twice. (Gemma's window layers need
    the block of positions 16..31, which the first sequence, at 33, still holds.)"""
    name, model = tiny
    cache = PagedKVCache(model.args, 128, n_seq=2, storage="anon")
    a = LONG[:33]
    b = LONG[:40] + [9, 9, 9]
    s0, n0 = cache.new_sequence(a)
    assert n0 == 0
    model.forward(a, cache, seq_ids=np.full(len(a), s0))
    s1, n1 = cache.new_sequence(b)
    assert (s0, s1, n1) == (0, 1, 32)
    shared = cache.manager.block_table(s1, 0)[:2]
    assert list(shared) == list(cache.manager.block_table(s0, 0)[:2])
    assert list(cache.manager.ref_counts(0)[shared]) == [2, 2]
    got = model.forward(b[32:], cache, seq_ids=np.full(len(b) - 32, s1))[0]
    cold = _run(model, model.new_cache(128), b, [len(b)])[-1]
    tol = 3e-2 if "quant" in name else 2e-4
    np.testing.assert_allclose(got, cold, rtol=0, atol=tol * np.abs(cold).max())
    cache.free(s1)
    cache.free(s0)
    stats = cache.manager.stats()
    assert stats.groups[0].used == 0 and stats.prefix_hit_tokens == 32


def test_sliding_window_blocks_released(tmp_path):
    """Gemma 3 with a window of 5 and blocks of 2: the local layers' group keeps only the
    blocks a query can see (holes before), the global group keeps all."""
    path = write_tiny_model(tmp_path / "g.gguf", arch="gemma3", n_layer=6, head_dim=32, sliding_window=5,
                            n_head=2, n_head_kv=1)
    model = load_model(GGUFFile(path))
    cache = PagedKVCache(model.args, 64, block_size=2, storage="anon")
    assert cache.layer_group == [1, 1, 1, 1, 1, 0]
    s, _ = cache.new_sequence(LONG[:20])
    model.forward(LONG[:20], cache, seq_ids=np.zeros(20, int))
    local, glob = cache.manager.block_table(s, 1), cache.manager.block_table(s, 0)
    # next query at 20 sees 16..20: blocks 8 (16, 17), 9 (18, 19) stay; 0..7 are released
    assert list(local[:8]) == [-1] * 8 and (local[8:] >= 0).all()
    assert (glob >= 0).all() and len(glob) == 10
    assert cache.manager.stats().groups[1].used == 2


def test_refusals_change_nothing(tmp_path):
    model = load_model(GGUFFile(write_tiny_model(tmp_path / "l.gguf", arch="llama")))
    cache = PagedKVCache(model.args, 8, n_seq=1, block_size=4, storage="anon")
    with pytest.raises(ValueError, match="the prompt has 9 tokens but n_ctx is 8"):
        cache.new_sequence(list(range(9)))
    s, _ = cache.new_sequence([1, 2, 3])
    with pytest.raises(NoFreeSlot, match="sequence slots"):
        cache.new_sequence([1, 2])
    model.forward([1, 2, 3], cache, seq_ids=[s, s, s])
    with pytest.raises(ValueError, match="not reserved"):
        model.forward([4], cache, seq_ids=[s])
    cache.append(s, list(range(5)))
    with pytest.raises(ValueError, match="context full"):
        cache.append(s, [1])
    assert cache.pos[s] == 3 and cache.num_tokens(s) == 8
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    per_token = kv_bytes_per_token(model.args, "f16", "f16")
    n_ctx = ram // per_token + 16                  # one block more than the RAM could hold
    with pytest.raises(ValueError, match=f"a KV cache of {n_ctx} positions needs .* GiB when full, more than "
                                         r"this machine's .* GiB of RAM; lower -c/--ctx-size"):
        PagedKVCache(model.args, n_ctx, storage="anon")


def test_pool_file_and_bytes_per_token(tmp_path):
    model = load_model(GGUFFile(write_tiny_model(tmp_path / "l.gguf", arch="llama", head_dim=32)))
    a = model.args
    cache = PagedKVCache(a, 4096, home=tmp_path)
    assert list((tmp_path / "kv").iterdir()) == []       # unlinked once mapped
    assert cache.bytes_per_token == a.n_layer * a.n_head_kv * (a.head_dim + a.head_dim_v) * 2
    assert kv_bytes_per_token(a, "q8_0", "q8_0") == a.n_layer * a.n_head_kv * (a.head_dim + a.head_dim_v) // 32 * 34
    assert cache.nbytes >= 4096 * cache.bytes_per_token
    with pytest.raises(ValueError, match="unknown KV cache type 'q4_0'"):
        PagedKVCache(a, 16, type_k="q4_0", storage="anon")


def test_window_blocks_forgotten_and_memory_returned(tmp_path):
    """Blocks that leave Gemma's window are forgotten (no hash, first in the free queue, so the
    next block taken reuses them) and their pages are given back: a long sequence keeps its
    window's pages only."""
    path = write_tiny_model(tmp_path / "g.gguf", arch="gemma3", n_layer=6, head_dim=256, sliding_window=32,
                            n_head=1, n_head_kv=1)
    model = load_model(GGUFFile(path))
    cache = PagedKVCache(model.args, 1024, block_size=16, storage="anon")
    s, _ = cache.new_sequence(LONG[:64])
    for i in range(0, 64, 16):
        model.forward(LONG[i : i + 16], cache, seq_ids=np.zeros(16, int))
    m = cache.manager
    # next query 64 sees 33..64: window blocks 0 and 1 (0..31) left, forgotten, first in the queue
    assert list(m.block_table(s, 1)[:2]) == [-1, -1] and m.free_queue(1)[:2] == [1, 0]
    assert all(m.block_hash(1, b) is None for b in (0, 1)) and m.block_hash(0, 0) is not None
    # their pages read as zeros again (returned); the blocks still in the window keep their K/V
    local = cache.k[0]
    assert not local[0].any() and not local[1].any() and local[m.block_table(s, 1)[2]].any()


@pytest.mark.parametrize("gid", ["qwen2.5-coder-0.5b", "gemma3-270m"])
def test_q8_0_kv_perplexity_real_model(gid):
    """The issue's measure: q8_0 K and V within 1% of f16 perplexity on all of ppl_text.txt
    (-c 256, 13 chunks). Qwen2.5's K has outliers (|K| up to ~210 where the rest varies by a
    few units): llama.cpp's Hadamard rotation alone leaves +1.1% (+1.06% in llama.cpp itself
    on 12 chunks); storing K minus the static part of its bias (static_k_bias) brings it to
    about -0.4%. Gemma 3 (no K bias, K normed) is about +0.5%; runs move by ~0.5% with rounding
    details, so the bound is the issue's, not a tighter one. Both through `edge perplexity`
    (the f16 run is the one tests/test_golden.py holds to llama.cpp's value)."""
    from tests.conftest import cli_perplexity

    ppl = {"f16": cli_perplexity(gid)[1], "q8_0": cli_perplexity(gid, "-ctk", "q8_0", "-ctv", "q8_0")[1]}
    assert abs(ppl["q8_0"] / ppl["f16"] - 1) < 0.01, ppl


def test_static_k_bias_pairs():
    """Qwen2.5's RoPE (base 1e6, 64 rotated dims, 32768 training positions): pairs 25..31 turn
    by at most 1 radian over the training context, so their bias is the shift; dims that RoPE
    does not rotate always are; a non-NeoX model pairs dims (2i, 2i+1)."""
    from dataclasses import replace

    from edge.models.rope import static_k_bias
    _, model = _tiny_qwen2()
    a = replace(model.args, head_dim=64, n_head_kv=2, n_rot=64, rope_freq_base=1e6, rope_freq_scale=1.0,
                n_ctx_train=32768, rope_neox=True)
    bias = np.arange(1, 129, dtype=np.float32)
    c = static_k_bias(a, bias)
    assert c.shape == (2, 64) and c.dtype == np.float32
    static = [d for d in range(64) if c[0, d]]
    assert static == list(range(25, 32)) + list(range(57, 64))
    assert np.array_equal(c[1, static], bias[64:][static])
    c = static_k_bias(replace(a, rope_neox=False), bias)
    assert [d for d in range(64) if c[0, d]] == list(range(50, 64))
    c = static_k_bias(replace(a, n_rot=32), bias)   # pairs (i, i+16) of 32 rotated dims, 32..63 not rotated
    assert [d for d in range(64) if c[0, d]] == list(range(13, 16)) + list(range(29, 64))
    c = static_k_bias(replace(a, n_ctx_train=4096), bias)
    assert [d for d in range(64) if c[0, d]] == list(range(20, 32)) + list(range(52, 64))  # fewer turns


def _tiny_qwen2(tmp=[]):
    if not tmp:
        import tempfile
        path = tempfile.mkdtemp() + "/qwen2.gguf"
        write_tiny_model(path, **CASES["qwen2-quant"])
        tmp.append(load_model(GGUFFile(path)))
    return "qwen2-quant", tmp[0]


def test_q8_0_k_shift_exact_and_effective():
    """A quantized K cache stores K minus the static part of the K bias: attention is unchanged
    in exact arithmetic (the logits stay close to an f32 cache's), while without the shift a
    large constant bias (as Qwen2.5's, up to 210) costs the rest of K its 8 bits."""
    from edge.models.rope import static_k_bias
    _, model = _tiny_qwen2()
    a = model.args
    saved = [(b.attn_k_bias, b.k_shift) for b in model.blocks]
    try:
        for b in model.blocks:
            mask = static_k_bias(a, np.ones_like(b.attn_k_bias)).reshape(-1) != 0
            assert 0 < mask.sum() < mask.size
            b.attn_k_bias = b.attn_k_bias + np.float32(200) * mask
            b.k_shift = static_k_bias(a, b.attn_k_bias)

        def logits(type_k):
            cache = PagedKVCache(a, 128, type_k=type_k, type_v="f32", storage="anon")
            return _run(model, cache, LONG, [40, 30])
        ref = logits("f32")
        shifted = logits("q8_0")
        for b in model.blocks:
            b.k_shift = None
        unshifted = logits("q8_0")
    finally:
        for b, (bias, shift) in zip(model.blocks, saved):
            b.attn_k_bias, b.k_shift = bias, shift
    err = lambda x: np.median(np.abs(x - ref).max(axis=1)) / np.abs(ref).max()   # as test_q8_0_kv_close_to_f16
    assert err(shifted) < 0.05, err(shifted)
    assert err(unshifted) > 4 * err(shifted), (err(unshifted), err(shifted))
