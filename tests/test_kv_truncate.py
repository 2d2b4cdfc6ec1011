"""Taking KV positions back (edge.kv: KVBlockManager.truncate, PagedKVCache.truncate, the
lookahead of sliding-window groups): exact block-manager states (tables, counts, free queue,
hashes), then the forward pass on tiny models: generate, truncate, generate again gives the
logits of a run that never went past the kept positions, bit for bit, in f16, f32 and q8_0."""
from __future__ import annotations

import numpy as np
import pytest

from edge.gguf_file import GGUFFile
from edge.kv import HOLE, KVBlockManager, KVGroup
from edge.kv.cache import PagedKVCache
from edge.models import load_model
from tests.test_kv_blocks import _computed, _state
from tests.tiny_models import write_tiny_model


def _manager(n_blocks=8, block_size=4, windows=(0,)) -> KVBlockManager:
    return KVBlockManager([KVGroup(n_blocks, w) for w in windows], block_size, b"model")


# ---- the block manager ------------------------------------------------------------------------

def test_truncate_inside_a_block_unregisters_it_and_forgets_the_dropped_ones():
    m = _manager()
    _computed(m, "a", list(range(10)))                   # blocks 0 1 2; 0 and 1 full, hashed
    h0 = m.block_hash(0, 0)
    m.truncate("a", 6)                                   # block 1 kept in part, block 2 dropped
    assert m.block_table("a").tolist() == [0, 1]
    assert (m.num_tokens("a"), m.num_computed_tokens("a"), m.token_ids("a").tolist()) == (6, 6, list(range(6)))
    assert m.cached_blocks() == {h0: 0} and m.block_hash(0, 1) is None
    assert m.free_queue() == [2, 3, 4, 5, 6, 7]          # the dropped block is taken first
    assert m.ref_counts().tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    m.append_tokens("a", [66, 67])
    m.mark_computed("a", 2)                              # block 1 full again, with the new tokens
    assert sorted(m.cached_blocks().values()) == [0, 1]
    assert m.allocate("b", list(range(10))) == 4          # the old tokens of block 1: no hit
    assert m.block_table("b").tolist() == [0, 2, 3]
    assert m.allocate("c", list(range(6)) + [66, 67, 1]) == 8
    assert m.block_table("c").tolist() == [0, 1, 4]


def test_truncate_at_a_block_boundary_keeps_the_full_blocks_registered():
    m = _manager()
    _computed(m, "a", list(range(12)))                   # blocks 0 1 2, all hashed
    hashes = m.cached_blocks()
    m.truncate("a", 8)
    assert m.block_table("a").tolist() == [0, 1]
    assert m.cached_blocks() == {h: b for h, b in hashes.items() if b != 2}
    assert m.free_queue() == [2, 3, 4, 5, 6, 7]
    m.free("a")
    assert m.allocate("b", list(range(13))) == 8          # block 2 is never served again
    assert m.block_table("b").tolist() == [0, 1, 2, 3]


def test_truncate_of_uncomputed_tokens_and_to_nothing():
    m = _manager()
    _computed(m, "a", list(range(5)))
    m.append_tokens("a", [5, 6, 7, 8])                   # reserved (drafts), not computed
    assert m.block_table("a").tolist() == [0, 1, 2]
    m.truncate("a", 7)
    assert (m.num_tokens("a"), m.num_computed_tokens("a"), m.block_table("a").tolist()) == (7, 5, [0, 1])
    m.truncate("a", 7)                                   # nothing to drop
    assert m.free_queue() == [2, 3, 4, 5, 6, 7]
    m.truncate("a", 0)
    assert (m.num_tokens("a"), m.num_computed_tokens("a"), m.block_table("a").tolist()) == (0, 0, [])
    assert m.cached_blocks() == {} and m.free_queue() == [0, 1, 2, 3, 4, 5, 6, 7]


def test_a_shared_partial_block_is_copied_and_stays_with_its_holders():
    m = _manager()
    _computed(m, "a", list(range(12)))
    assert m.allocate("b", list(range(12)) + [50]) == 12   # b shares blocks 0 1 2, has 3
    m.mark_computed("b", 1)
    before = _state(m, ["a", "b"])
    with pytest.raises(ValueError, match="copy_block callback"):
        m.truncate("b", 6)
    with pytest.raises(RuntimeError, match="disk full"):
        m.truncate("b", 6, lambda *a: (_ for _ in ()).throw(RuntimeError("disk full")))
    assert _state(m, ["a", "b"]) == before                 # a failed copy changes nothing
    copies = []
    m.truncate("b", 6, lambda *a: copies.append(a))
    assert copies == [(0, 1, 4, 2)]                        # group 0: block 1's first 2 slots -> 4
    assert (m.block_table("b").tolist(), m.block_table("a").tolist()) == ([0, 4], [0, 1, 2])
    assert m.ref_counts().tolist() == [2, 1, 1, 0, 1, 0, 0, 0]
    assert sorted(m.cached_blocks().values()) == [0, 1, 2]  # a's blocks are intact
    assert m.free_queue() == [3, 5, 6, 7] and m.num_computed_tokens("b") == 6


def test_window_blocks_stay_for_the_lookahead():
    m = _manager(16, 4, (0, 4))
    _computed(m, "k0", list(range(12)))                  # lookahead 0: blocks 0 1 out of the window
    assert m.block_table("k0", 1).tolist() == [HOLE, HOLE, 2]
    before = _state(m, ["k0"])
    with pytest.raises(ValueError, match="window blocks .* released \\(lookahead 0\\)"):
        m.truncate("k0", 10)                             # a query at 10 sees position 7, in block 1
    assert _state(m, ["k0"]) == before
    m.truncate("k0", 11)
    m.free("k0")
    m.allocate("k2", list(range(100, 112)), lookahead=2)
    m.mark_computed("k2", 12)
    assert m.block_table("k2", 1).tolist() == [HOLE, 4, 5]   # a query at 10 still sees block 1
    with pytest.raises(ValueError, match="lookahead 2"):
        m.truncate("k2", 6)
    m.truncate("k2", 9)
    assert (m.block_table("k2", 0).tolist(), m.block_table("k2", 1).tolist()) == ([3, 4, 5], [HOLE, 4, 5])
    m.append_tokens("k2", [7, 8, 9, 10, 11])
    m.mark_computed("k2", 5)                             # at 14: a query at 12 sees from block 2
    assert m.block_table("k2", 1).tolist() == [HOLE, HOLE, 5, 6]


def test_truncate_refuses_bad_input():
    m = _manager()
    _computed(m, "a", list(range(6)))
    for bad in (-1, 7, 2.0, None):
        with pytest.raises(ValueError, match="n_keep must be an integer in \\[0, 6\\]"):
            m.truncate("a", bad)
    with pytest.raises(KeyError, match="unknown sequence 'x'"):
        m.truncate("x", 0)
    with pytest.raises(ValueError, match="lookahead must be an integer >= 0, got -1"):
        m.allocate("b", [1, 2], lookahead=-1)


# ---- the paged cache in the forward pass ------------------------------------------------------

PROMPT = [1, 7, 33, 2, 90, 15, 61, 8, 44, 3]       # 10 tokens: blocks of 4 hold 0-3, 4-7, 8-11
GEN = [21, 5, 77, 13, 60, 9, 31, 48]              # decoded one at a time after the prompt
ALT = [11, 70, 3, 52, 26]                         # decoded after the truncation


@pytest.fixture(scope="module", params=["gemma3-swa", "llama"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf"
    if request.param == "gemma3-swa":               # window 4: every decode step leaves blocks behind
        write_tiny_model(path, arch="gemma3", n_layer=3, head_dim=32, sliding_window=4, n_head=2, n_head_kv=1)
    else:
        write_tiny_model(path, arch="llama", n_head=2, n_head_kv=1)   # head_dim 32: q8_0 can hold it
    return load_model(GGUFFile(path))


def _decode(model, cache, slot, tokens) -> list[np.ndarray]:
    """Logits after each of ``tokens``, fed one forward pass each."""
    out = []
    for t in tokens:
        cache.append(slot, [t])
        out.append(model.forward([t], cache, seq_ids=[slot])[-1])
    return out


@pytest.mark.parametrize("kv_type", ["f16", "f32", "q8_0"])
@pytest.mark.parametrize("n_keep", [13, 16], ids=["inside-a-block", "at-a-block-boundary"])
def test_generate_truncate_generate_equals_a_run_that_never_went_further(tiny, kv_type, n_keep):
    model = tiny

    def cache():
        return PagedKVCache(model.args, 64, n_seq=2, block_size=4, type_k=kv_type, type_v=kv_type, storage="anon")

    kv = cache()
    slot, _ = kv.new_sequence(PROMPT, lookahead=len(PROMPT) + len(GEN) - n_keep)
    model.forward(PROMPT, kv, seq_ids=[slot] * len(PROMPT))
    _decode(model, kv, slot, GEN)
    kv.truncate(slot, n_keep)
    assert (int(kv.pos[slot]), kv.num_tokens(slot)) == (n_keep, n_keep)
    got = _decode(model, kv, slot, ALT)
    ref_kv = cache()
    ref, _ = ref_kv.new_sequence(PROMPT)
    model.forward(PROMPT, ref_kv, seq_ids=[ref] * len(PROMPT))
    _decode(model, ref_kv, ref, GEN[: n_keep - len(PROMPT)])
    want = _decode(model, ref_kv, ref, ALT)
    for g, w in zip(got, want):
        assert np.array_equal(g, w)
    if not any(model.args.swa_layers):                # the prefix cache never serves a dropped block
        kv.free(slot)
        s2, n_cached = kv.new_sequence(PROMPT + GEN)
        assert n_cached == n_keep // 4 * 4


def test_truncate_past_the_lookahead_of_a_window_is_refused(tiny):
    model = tiny
    if not any(model.args.swa_layers):
        pytest.skip("no sliding window")
    kv = PagedKVCache(model.args, 64, block_size=4, storage="anon")
    slot, _ = kv.new_sequence(PROMPT, lookahead=2)
    model.forward(PROMPT, kv)
    _decode(model, kv, slot, GEN)
    with pytest.raises(ValueError, match="window blocks for that position were released \\(lookahead 2\\)"):
        kv.truncate(slot, 13)
    assert (int(kv.pos[slot]), kv.num_tokens(slot)) == (18, 18)
    kv.truncate(slot, 16)
    assert int(kv.pos[slot]) == 16


def test_a_shared_partial_block_is_copied_in_every_layer(tiny):
    """Two sequences share a computed prefix; one truncates inside a shared block and writes
    other tokens there: each gets the logits of its own tokens (the kept slots were copied, the
    shared block left as it was)."""
    model = tiny
    kv = PagedKVCache(model.args, 64, n_seq=2, block_size=4, storage="anon")
    a, _ = kv.new_sequence(PROMPT + GEN[:2])             # 12 tokens: three full blocks
    model.forward(PROMPT + GEN[:2], kv)
    b, n_cached = kv.new_sequence(PROMPT + GEN[:2] + [5], lookahead=8)
    assert n_cached == 12 or any(model.args.swa_layers)
    model.forward((PROMPT + GEN[:2] + [5])[n_cached:], kv, seq_ids=[b] * (13 - n_cached))
    kv.truncate(b, 10)                                   # inside block 2, which a holds too
    got_b = _decode(model, kv, b, ALT)
    got_a = _decode(model, kv, a, GEN[2:4])
    for tokens, got, then in ((PROMPT + GEN[:2], got_a, GEN[2:4]), (PROMPT, got_b, ALT)):
        ref_kv = PagedKVCache(model.args, 64, block_size=4, storage="anon")
        ref, _ = ref_kv.new_sequence(tokens)
        model.forward(tokens, ref_kv)
        want = _decode(model, ref_kv, ref, then)
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
