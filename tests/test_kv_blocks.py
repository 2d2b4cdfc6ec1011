"""The KV block allocator (edge/kv/blocks.py): exact block ids, reference counts, free-queue
order, prefix hits, eviction, window holes and refusals, plus a randomized run against a
plain reference model of the same rules (written with lists and linear scans)."""
from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from edge.kv import HOLE, GroupStats, KVBlockManager, KVGroup, NoFreeBlocks


def _manager(n_blocks=8, block_size=4, windows=(0,), extra_key=b"model") -> KVBlockManager:
    return KVBlockManager([KVGroup(n_blocks, w) for w in windows], block_size, extra_key)


def _state(m: KVBlockManager, seq_ids) -> tuple:
    """Everything observable, to compare before and after a refused call."""
    groups = range(len(m.groups))
    return ([m.free_queue(g) for g in groups], [m.ref_counts(g).tolist() for g in groups],
            [m.cached_blocks(g) for g in groups],
            [(m.block_table(s, g).tolist(), m.num_tokens(s), m.num_computed_tokens(s))
             for s in seq_ids for g in groups], m.stats())


def _computed(m, seq_id, prompt) -> int:
    """allocate + mark the rest of the prompt computed; returns the hit length."""
    n_cached = m.allocate(seq_id, prompt)
    m.mark_computed(seq_id, len(prompt) - n_cached)
    return n_cached


# ---- blocks, tables, counts, free queue -----------------------------------------------------

def test_fresh_allocation_takes_blocks_from_the_head():
    m = _manager()
    assert m.allocate("a", list(range(10))) == 0
    assert m.block_table("a").tolist() == [0, 1, 2]
    assert m.ref_counts().tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert m.free_queue() == [3, 4, 5, 6, 7]
    assert (m.num_tokens("a"), m.num_computed_tokens("a")) == (10, 0)
    assert m.allocate("b", [5, 6, 7]) == 0
    assert m.block_table("b").tolist() == [3]
    assert m.num_free_blocks() == 4
    assert m.stats().groups == (GroupStats(n_blocks=8, used=4, free=4, cached_free=0),)


def test_only_full_computed_blocks_are_hashed_by_the_documented_chain():
    m = _manager(extra_key=b"model")
    prompt = list(range(100, 110))
    m.allocate("a", prompt)
    m.mark_computed("a", 5)
    assert m.block_hash(0, 0) is not None and m.block_hash(0, 1) is None
    m.mark_computed("a", 5)
    root = hashlib.blake2b(b"edge.kv.root" + (5).to_bytes(8, "little") + b"model"
                           + (4).to_bytes(4, "little"), digest_size=32).digest()
    h0 = hashlib.blake2b(root + np.arange(100, 104, dtype="<i4").tobytes(), digest_size=32).digest()
    h1 = hashlib.blake2b(h0 + np.arange(104, 108, dtype="<i4").tobytes(), digest_size=32).digest()
    assert (m.block_hash(0, 0), m.block_hash(0, 1), m.block_hash(0, 2)) == (h0, h1, None)
    assert m.cached_blocks() == {h0: 0, h1: 1}


def test_free_returns_every_block_last_block_first():
    m = _manager()
    _computed(m, "a", list(range(10)))   # blocks 0 1 2
    m.allocate("b", list(range(50, 57)))  # blocks 3 4
    m.free("a")
    assert m.free_queue() == [5, 6, 7, 2, 1, 0]
    m.free("b")
    assert m.free_queue() == [5, 6, 7, 2, 1, 0, 4, 3]
    assert m.ref_counts().tolist() == [0] * 8
    assert m.stats().groups == (GroupStats(n_blocks=8, used=0, free=8, cached_free=2),)
    with pytest.raises(KeyError, match="unknown sequence 'a'"):
        m.block_table("a")


def test_append_tokens_grows_the_table_one_block_when_the_last_is_full():
    m = _manager()
    _computed(m, "a", [1, 2, 3])
    steps = [(4, [0]), (5, [0, 1]), (6, [0, 1]), (7, [0, 1]), (8, [0, 1]), (9, [0, 1, 2])]
    for token, table in steps:
        m.append_tokens("a", [token])
        assert m.block_table("a").tolist() == table
        m.mark_computed("a", 1)
    assert m.token_ids("a").tolist() == list(range(1, 10))
    table = m.block_table("a")
    m.append_tokens("a", [10, 11, 12, 13])   # a new block: a new array, the old one unchanged
    assert (table.tolist(), m.block_table("a").tolist()) == ([0, 1, 2], [0, 1, 2, 3])
    assert not table.flags.writeable
    assert sorted(m.cached_blocks().values()) == [0, 1]
    assert m.block_hash(0, 2) is None
    m.mark_computed("a", 4)                  # 13 tokens: block 2 full
    assert sorted(m.cached_blocks().values()) == [0, 1, 2]


def test_slots_of_positions_across_blocks():
    m = _manager()
    m.allocate("x", [9] * 3)
    m.allocate("a", list(range(11)))    # blocks 1 2 3
    block_ids, offsets = m.slots("a", 0, 2, 7)
    assert block_ids.dtype == np.int32 and offsets.dtype == np.int32
    assert block_ids.tolist() == [1, 1, 2, 2, 2, 2, 3]
    assert offsets.tolist() == [2, 3, 0, 1, 2, 3, 0]
    with pytest.raises(ValueError, match="outside the 11 known tokens"):
        m.slots("a", 0, 8, 4)


# ---- prefix hits --------------------------------------------------------------------------

def test_two_sequences_share_a_prefix():
    m = _manager()
    _computed(m, "a", list(range(10)))
    assert m.allocate("b", list(range(8)) + [77, 78]) == 8
    assert m.block_table("b").tolist() == [0, 1, 3]
    assert m.ref_counts().tolist()[:4] == [2, 2, 1, 1]
    assert m.num_computed_tokens("b") == 8
    stats = m.stats()
    assert (stats.prefix_queries, stats.prefix_query_tokens, stats.prefix_hit_tokens) == (2, 20, 8)
    m.free("a")
    assert m.ref_counts().tolist()[:4] == [1, 1, 0, 1]
    assert m.free_queue() == [4, 5, 6, 7, 2]


def test_last_prompt_token_is_always_computed():
    m = _manager()
    _computed(m, "a", list(range(8)))
    assert m.allocate("b", list(range(8))) == 4   # both blocks cached, the last one is not used
    assert m.block_table("b").tolist() == [0, 2]
    assert m.allocate("c", list(range(9))) == 8
    assert m.block_table("c").tolist() == [0, 1, 3]
    assert m.allocate("d", [0, 1, 2, 3]) == 0
    assert m.block_table("d").tolist() == [4]


def test_a_change_in_an_earlier_block_or_the_extra_key_misses():
    m = _manager(n_blocks=16)
    _computed(m, "a", list(range(13)))
    assert m.allocate("b", [0, 99] + list(range(2, 13))) == 0       # block 1 equal, parent not
    assert m.allocate("c", list(range(5)) + [99] + list(range(6, 13))) == 4
    other = _manager(extra_key=b"other model")
    _computed(other, "a", list(range(13)))
    assert set(other.cached_blocks()).isdisjoint(m.cached_blocks())
    assert len(m.cached_blocks()) == 3


def test_hit_on_blocks_in_the_free_queue():
    m = _manager()
    _computed(m, "a", list(range(10)))
    m.free("a")
    assert m.free_queue() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert m.stats().groups[0].cached_free == 2
    assert m.allocate("b", list(range(9))) == 8
    assert m.block_table("b").tolist() == [0, 1, 3]
    assert m.free_queue() == [4, 5, 6, 7, 2]
    assert m.ref_counts().tolist() == [1, 1, 0, 1, 0, 0, 0, 0]


def test_eviction_in_lru_order_drops_the_hash():
    m = _manager(n_blocks=6)
    _computed(m, "a", list(range(12)))   # blocks 0 1 2, all hashed
    m.free("a")
    assert m.free_queue() == [3, 4, 5, 2, 1, 0]
    m.allocate("b", [50] * 16)            # takes 3 4 5 2: block 2 (the prefix's last) evicted
    assert m.block_table("b").tolist() == [3, 4, 5, 2]
    assert m.block_hash(0, 2) is None and sorted(m.cached_blocks().values()) == [0, 1]
    m.free("b")
    assert m.free_queue() == [1, 0, 2, 5, 4, 3]
    assert m.allocate("c", list(range(13))) == 8   # blocks 0 1 still hit
    assert m.block_table("c").tolist() == [0, 1, 2, 5]
    assert m.free_queue() == [4, 3]


def test_eviction_exact_queue_after_reuse():
    m = _manager(n_blocks=6)
    _computed(m, "a", list(range(12)))
    m.free("a")                           # queue 3 4 5 2 1 0
    m.allocate("b", [50] * 8)             # takes 3 4
    assert m.allocate("c", list(range(13))) == 12
    assert m.block_table("c").tolist() == [0, 1, 2, 5]
    assert m.free_queue() == []
    m.free("c")
    assert m.free_queue() == [5, 2, 1, 0]
    m.free("b")
    assert m.free_queue() == [5, 2, 1, 0, 4, 3]


def test_a_prefix_computed_twice_is_registered_once():
    m = _manager()
    prompt = list(range(9))
    assert m.allocate("a", prompt) == 0 and m.allocate("b", prompt) == 0   # concurrently
    m.mark_computed("a", 9)
    m.mark_computed("b", 9)
    assert m.block_table("b").tolist() == [3, 4, 5]
    assert m.cached_blocks() == {m.block_hash(0, 0): 0, m.block_hash(0, 1): 1}
    assert m.block_hash(0, 3) is None and m.block_hash(0, 4) is None
    assert m.allocate("c", prompt) == 8
    assert m.block_table("c").tolist() == [0, 1, 6]


# ---- refusals -----------------------------------------------------------------------------

def test_refusal_changes_nothing():
    m = _manager(n_blocks=4)
    _computed(m, "a", list(range(9)))    # blocks 0 1 2
    m.free("a")                          # queue 3 2 1 0
    m.allocate("b", [60] * 2)            # block 3
    before = _state(m, ["b"])
    # two hits on free blocks (0 1) + two fresh: 4 free-queue entries needed, 3 there
    with pytest.raises(NoFreeBlocks, match="group 0: 4 free blocks needed, 3 available"):
        m.allocate("c", list(range(8)) + [1] * 5)
    assert not m.can_allocate(list(range(8)) + [1] * 5)
    assert m.can_allocate(list(range(8)) + [1] * 4)
    assert not m.can_allocate(list(range(8)) + [1] * 4, reserve_tokens=1)
    assert _state(m, ["b"]) == before
    m.append_tokens("b", [61, 62])       # fills block 3, needs no block
    before = _state(m, ["b"])
    with pytest.raises(NoFreeBlocks):
        m.append_tokens("b", [1] * 13)
    assert _state(m, ["b"]) == before
    with pytest.raises(KeyError):
        m.num_tokens("c")


def test_refusal_in_one_group_changes_no_group():
    m = KVBlockManager([KVGroup(8), KVGroup(2, window=4)], block_size=4)
    m.allocate("a", [1] * 5)
    before = _state(m, ["a"])
    with pytest.raises(NoFreeBlocks, match="group 1: 2 free blocks needed, 0 available"):
        m.allocate("b", [2] * 5)
    assert _state(m, ["a"]) == before


def test_bad_input_is_a_clear_error():
    m = _manager()
    m.allocate("a", [1, 2])
    with pytest.raises(ValueError, match="already exists"):
        m.allocate("a", [1])
    with pytest.raises(ValueError, match="empty prompt"):
        m.allocate("e", [])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2147483647\]"):
        m.allocate("n", [3, -1])
    with pytest.raises(ValueError, match="integer token ids"):
        m.append_tokens("a", [1.5])
    with pytest.raises(ValueError, match="2 uncomputed"):
        m.mark_computed("a", 3)
    with pytest.raises(KeyError, match="unknown sequence 'zz'"):
        m.free("zz")
    with pytest.raises(ValueError, match="n_blocks must be >= 1"):
        KVGroup(0)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        KVBlockManager([KVGroup(4)], block_size=0)
    with pytest.raises(TypeError, match="extra_key must be bytes, got str"):
        KVBlockManager([KVGroup(4)], extra_key="qwen")


# ---- sliding windows ----------------------------------------------------------------------

def test_window_releases_blocks_out_of_reach_as_holes():
    m = _manager(windows=(6,))
    m.allocate("a", list(range(12)))
    m.mark_computed("a", 11)              # next query 11 sees 6..11: block 0 (0..3) unreachable
    assert m.block_table("a").tolist() == [HOLE, 1, 2]
    assert m.free_queue() == [3, 4, 5, 6, 7, 0]
    assert m.block_hash(0, 0) is not None  # released, still cached
    with pytest.raises(ValueError, match="released out of the window"):
        m.slots("a", 0, 3, 2)
    m.mark_computed("a", 1)               # query 12 sees 7..12: block 1 (4..7) still needed
    assert m.block_table("a").tolist() == [HOLE, 1, 2]
    m.append_tokens("a", [12])
    m.mark_computed("a", 1)               # query 13 sees 8..13
    assert m.block_table("a").tolist() == [HOLE, HOLE, 2, 3]
    assert m.free_queue() == [4, 5, 6, 7, 0, 1]
    m.free("a")
    assert m.free_queue() == [4, 5, 6, 7, 0, 1, 3, 2]


def test_window_hit_needs_only_the_blocks_in_the_window():
    m = _manager(windows=(5,))
    _computed(m, "a", list(range(13)))    # query 13 sees 9..13: blocks 0 1 released
    assert m.block_table("a").tolist() == [HOLE, HOLE, 2, 3]
    # hit of 12 tokens: query 12 sees 8..12, so blocks 2 (8..11) cached is enough
    assert m.allocate("b", list(range(13))) == 12
    assert m.block_table("b").tolist() == [HOLE, HOLE, 2, 4]
    assert m.ref_counts().tolist()[:5] == [0, 0, 2, 1, 1]


def test_hybrid_hit_length_is_the_largest_all_groups_satisfy():
    m = KVBlockManager([KVGroup(16), KVGroup(10, window=4)], block_size=4)
    _computed(m, "a", list(range(17)))    # query 17 sees 14..17: window blocks 0 1 2 released
    assert m.block_table("a", 1).tolist() == [HOLE, HOLE, HOLE, 3, 4]
    m.free("a")
    assert m.free_queue(1) == [5, 6, 7, 8, 9, 0, 1, 2, 4, 3]
    m.allocate("x", [7] * 24)             # window group takes 5..9 and 0: evicts block 0 (0..3)
    assert m.block_table("x", 1).tolist() == [5, 6, 7, 8, 9, 0]
    # L = 16: full blocks 0..3 and window block 3 (positions 13..15) cached
    assert m.allocate("b", list(range(17))) == 16
    assert m.block_table("b", 0).tolist() == [0, 1, 2, 3, 11]
    assert m.block_table("b", 1).tolist() == [HOLE, HOLE, HOLE, 3, 1]   # fresh 1: evicted
    m.free("b")
    assert m.free_queue(1) == [2, 4, 1, 3]
    # hold window block 2 (positions 8..11) with a 12-token hit, then evict window block 3
    assert m.allocate("e", list(range(13))) == 12
    assert m.block_table("e", 1).tolist() == [HOLE, HOLE, 2, 4]
    m.free("x")
    assert m.free_queue(1) == [1, 3, 0, 9, 8, 7, 6, 5]
    m.allocate("y", [8] * 8)              # window group takes 1 3
    assert m.block_hash(1, 3) is None and m.block_hash(1, 2) is not None
    # full group still has all 4 blocks; the window group only supports L = 12
    assert m.allocate("d", list(range(17))) == 12
    assert m.block_table("d", 0).tolist() == [0, 1, 2, 15, 4]   # full block 3 recomputed
    assert m.block_table("d", 1).tolist() == [HOLE, HOLE, 2, 0, 9]
    assert m.ref_counts(1)[2] == 2


def test_restore_keeps_only_the_window_and_hits_all_full_blocks():
    m = KVBlockManager([KVGroup(16), KVGroup(8, window=5)], block_size=4)
    tokens = list(range(200, 214))        # 14 tokens; query 14 sees 10..14
    assert m.restore("s", tokens) == 0
    assert m.block_table("s", 0).tolist() == [0, 1, 2, 3]
    assert m.block_table("s", 1).tolist() == [HOLE, HOLE, 0, 1]
    m.mark_computed("s", 14)
    assert len(m.cached_blocks(0)) == 3 and len(m.cached_blocks(1)) == 1   # window: block 2 only
    m.free("s")
    assert m.restore("t", tokens[:12]) == 12   # no last-token rule: all 3 full blocks hit
    assert m.block_table("t", 0).tolist() == [0, 1, 2]
    assert m.block_table("t", 1).tolist() == [HOLE, HOLE, 0]
    assert m.num_computed_tokens("t") == 12
    assert m.stats().prefix_queries == 0


# ---- randomized run against a reference model ---------------------------------------------

class _Reference:
    """The same rules with lists and linear scans."""

    def __init__(self, windows, n_blocks, bs, extra_key):
        self.windows, self.bs = windows, bs
        self.count = [[0] * n_blocks for _ in windows]
        self.hash = [[None] * n_blocks for _ in windows]
        self.queue = [list(range(n_blocks)) for _ in windows]
        self.seqs = {}  # id -> [tokens, n_computed, tables]
        self.root = hashlib.blake2b(b"edge.kv.root" + len(extra_key).to_bytes(8, "little")
                                    + extra_key + bs.to_bytes(4, "little"), digest_size=32).digest()

    def chain(self, tokens, n_blocks):
        out, h = [], self.root
        for k in range(n_blocks):
            h = hashlib.blake2b(h + b"".join(t.to_bytes(4, "little")
                                             for t in tokens[k * self.bs:(k + 1) * self.bs]),
                                digest_size=32).digest()
            out.append(h)
        return out

    def find(self, g, h):
        return self.hash[g].index(h) if h in self.hash[g] else None

    def visible_from(self, g, p):
        w = self.windows[g]
        return 0 if w == 0 else max(0, p - w + 1) // self.bs

    def start(self, sid, tokens, restore):
        max_hit = len(tokens) // self.bs if restore else (len(tokens) - 1) // self.bs
        hs = self.chain(tokens, max_hit)
        groups = range(len(self.windows))

        def query(nb):
            return len(tokens) if restore else nb * self.bs

        nb = max_hit
        while nb and not all(self.find(g, hs[k]) is not None for g in groups
                             for k in range(self.visible_from(g, query(nb)), nb)):
            nb -= 1
        n_table = -(-len(tokens) // self.bs)
        firsts = [self.visible_from(g, query(nb)) for g in groups]
        hits = [[self.find(g, hs[k]) for k in range(firsts[g], nb)] for g in groups]
        for g in groups:
            need = n_table - max(firsts[g], nb) + sum(self.count[g][b] == 0 for b in hits[g])
            if need > len(self.queue[g]):
                return None
        tables = []
        for g in groups:
            for b in hits[g]:
                if self.count[g][b] == 0:
                    self.queue[g].remove(b)
                self.count[g][b] += 1
            fresh = [self.take(g) for _ in range(n_table - max(firsts[g], nb))]
            tables.append([HOLE] * firsts[g] + hits[g] + fresh)
        self.seqs[sid] = [list(tokens), nb * self.bs, tables]
        return nb * self.bs

    def take(self, g):
        b = self.queue[g].pop(0)
        self.hash[g][b] = None
        self.count[g][b] = 1
        return b

    def release(self, g, b):
        self.count[g][b] -= 1
        if self.count[g][b] == 0:
            self.queue[g].append(b)

    def append(self, sid, tokens):
        seq = self.seqs[sid]
        n_table = -(-(len(seq[0]) + len(tokens)) // self.bs)
        if any(n_table - len(t) > len(q) for t, q in zip(seq[2], self.queue)):
            return False
        seq[0] += tokens
        for g, t in enumerate(seq[2]):
            t += [self.take(g) for _ in range(n_table - len(t))]
        return True

    def mark(self, sid, n):
        seq = self.seqs[sid]
        old, new = seq[1], seq[1] + n
        hs = self.chain(seq[0], new // self.bs)
        for g, t in enumerate(seq[2]):
            for k in range(old // self.bs, new // self.bs):
                if t[k] != HOLE and self.find(g, hs[k]) is None:
                    self.hash[g][t[k]] = hs[k]
            w = self.windows[g]
            for k in range(len(t)):
                if w and t[k] != HOLE and (k + 1) * self.bs - 1 <= new - w:
                    self.release(g, t[k])
                    t[k] = HOLE
        seq[1] = new

    def free(self, sid):
        for g, t in enumerate(self.seqs.pop(sid)[2]):
            for b in t[::-1]:
                if b != HOLE:
                    self.release(g, b)


def _same_state(m: KVBlockManager, ref: _Reference):
    for g in range(len(ref.windows)):
        assert m.free_queue(g) == ref.queue[g]
        assert m.ref_counts(g).tolist() == ref.count[g]
        assert [m.block_hash(g, b) for b in range(len(ref.count[g]))] == ref.hash[g]
        cached = m.cached_blocks(g)
        assert cached == {h: b for b, h in enumerate(ref.hash[g]) if h is not None}
        # every block is either free (count 0, queued once) or held (count > 0, not queued)
        queue = m.free_queue(g)
        assert len(set(queue)) == len(queue)
        assert {b for b, c in enumerate(ref.count[g]) if c == 0} == set(queue)
        refs = [b for s in ref.seqs for b in m.block_table(s, g).tolist() if b != HOLE]
        assert sum(ref.count[g]) == len(refs)
        assert all(m.block_hash(g, b) == h for h, b in cached.items())
    for sid, (tokens, n_computed, tables) in ref.seqs.items():
        assert m.token_ids(sid).tolist() == tokens
        assert m.num_computed_tokens(sid) == n_computed
        assert [m.block_table(sid, g).tolist() for g in range(len(tables))] == tables


@pytest.mark.parametrize("seed, windows, block_size", [
    (0, (0,), 2), (1, (0,), 3), (2, (5,), 2), (3, (0, 3), 2), (4, (0, 7), 3), (5, (4, 0), 1)])
def test_random_steps_match_the_reference_model(seed, windows, block_size):
    rng = random.Random(seed)
    n_blocks = 14
    m = KVBlockManager([KVGroup(n_blocks, w) for w in windows], block_size, b"key")
    ref = _Reference(windows, n_blocks, block_size, b"key")
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(12))] for _ in range(3)]
    refused = hits = 0
    for step in range(400):
        op = rng.random()
        sids = list(ref.seqs)
        if op < 0.3 and len(sids) < 5:
            sid = f"s{step}"
            tokens = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randint(1, 6))]
            restore = rng.random() < 0.2
            expected = ref.start(sid, tokens, restore)
            call = m.restore if restore else m.allocate
            if expected is None:
                with pytest.raises(NoFreeBlocks):
                    call(sid, tokens)
                refused += 1
            else:
                assert call(sid, tokens) == expected
                hits += expected > 0
        elif op < 0.6 and sids:
            sid = rng.choice(sids)
            left = len(ref.seqs[sid][0]) - ref.seqs[sid][1]
            if left:
                n = rng.randint(1, left)
                ref.mark(sid, n)
                m.mark_computed(sid, n)
            else:
                tokens = [rng.randrange(3) for _ in range(rng.randint(1, 3))]
                if ref.append(sid, tokens):
                    m.append_tokens(sid, tokens)
                else:
                    with pytest.raises(NoFreeBlocks):
                        m.append_tokens(sid, tokens)
                    refused += 1
        elif sids:
            sid = rng.choice(sids)
            ref.free(sid)
            m.free(sid)
        _same_state(m, ref)
    assert refused > 0 and hits > 5   # the run exercised refusals and prefix hits
