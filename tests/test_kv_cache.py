"""The paged KV cache (edge.kv.cache) in the forward pass, on tiny random-weight models of
every architecture: the same logits as the contiguous reference cache for any block size,
chunking and KV type; prefix caching; sliding-window blocks released and reused."""
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


def test_q8_0_kv_perplexity_real_model(qwen_path):
    """Qwen2.5's K has outliers (|K| up to ~160 where the median is ~2): without llama.cpp's
    Hadamard rotation of Q and K, 8-bit K and V cost it 3-4% perplexity here; with it about
    1.1% on 12 chunks, as llama.cpp's own q8_0 cache (1.06%, flash attention, same text)."""
    from edge.engine import Engine
    from edge.perplexity import perplexity
    from tests.conftest import GOLDEN

    text = (GOLDEN / "ppl_text.txt").read_text()
    ppl = {t: perplexity(Engine(qwen_path, n_ctx=256, cache_type_k=t, cache_type_v=t), text, 256, max_chunks=4).ppl
           for t in ("f16", "q8_0")}
    assert abs(ppl["q8_0"] / ppl["f16"] - 1) < 0.02, ppl
