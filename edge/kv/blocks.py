"""KV block allocator with prefix caching: the pure-Python bookkeeping of the paged KV cache.

The design follows vLLM v1's block manager (kv_cache_manager.py, block_pool.py: here
edge.kv.block_pool holds a group's blocks, free queue and hash map); the storage (block pools of
K/V) and the attention kernels that read it through block tables live elsewhere.

Blocks and tables
    A manager holds one or more layer groups (:class:`KVGroup`); each group has its own pool of
    ``n_blocks`` blocks (ids ``0 .. n_blocks-1``) of ``block_size`` token slots, its own prefix
    hash map and its own attention window (0 = full attention). A sequence has one block table
    per group: token position ``i`` lives in block ``table[i // block_size]``, slot
    ``i % block_size``. A block's reference count is the number of tables holding it.

Token states of a sequence
    *known* tokens (``num_tokens``: the prompt, then appended tokens) always have slots: the
    tables cover every known position, except window holes (below). *Computed* tokens
    (``num_computed_tokens`` <= ``num_tokens``) have their K/V written. The contract:

    1. ``n_cached = allocate(seq_id, prompt_ids)``: reuses the longest cached prefix (``n_cached``
       tokens, a multiple of ``block_size``, already computed) and reserves fresh blocks for
       the rest of the prompt. It raises :class:`NoFreeBlocks` and changes nothing when the
       pool cannot hold the prompt.
    2. The caller writes the K/V of positions ``n_cached ..`` (at :meth:`~KVBlockManager.slots`),
       in one forward or in chunks, calling ``mark_computed(seq_id, n)`` after each forward that
       wrote the next ``n`` positions.
    3. Decoding: ``append_tokens(seq_id, [token])`` reserves the sampled token's slot before the
       forward that writes its K/V, then ``mark_computed(seq_id, 1)``.
    4. ``truncate(seq_id, n_keep)`` to take back positions (rejected draft tokens): the
       tokens from ``n_keep`` on are dropped, computed or not, and the caller computes others
       there (see Truncation).
    5. ``free(seq_id)`` when the sequence ends (or is preempted).

    A scheduler admits a waiting prompt when ``can_allocate(prompt_ids, reserve_tokens)``;
    ``append_tokens`` raising :class:`NoFreeBlocks` (nothing changed) is its cue to preempt.
    Window groups also reserve every prompt position at ``allocate``; blocks leave the window
    only as ``mark_computed`` advances, so a long prompt's peak is its whole length.

Prefix hashes
    Only full, computed blocks are hashed and registered (at ``mark_computed``, so a hit never
    reaches a block whose K/V is not yet written). ``hash(block k) = blake2b-256(
    hash(block k-1) || token ids of block k as little-endian int32)``, with ``hash(block -1) =
    blake2b-256(b"edge.kv.root" || len(extra_key) as little-endian uint64 || extra_key ||
    block_size as little-endian uint32)``. ``extra_key`` names the model (file hash, size,
    name) and the KV type, so caches of different models or KV types never collide; layer
    groups cannot collide since each has its own hash map. Python's ``hash()`` is never used.
    When a block becomes full and computed and its hash is already registered (two sequences
    computed the same prefix at once), the table keeps its own block, which stays unhashed.

Free queue and eviction
    Blocks with reference count 0 sit in one LRU free queue per group: new blocks are taken
    from the head, released blocks appended at the tail. A free block keeps its hash and can
    be hit until it is taken for new data (eviction: its hash entry is dropped). A hit on a
    free block takes it out of the queue (O(1), ``OrderedDict``) with count 1; a hit on a held
    block adds 1 to its count. ``free`` releases a sequence's blocks in reverse table order
    (last block first), so the first blocks of a prefix, the most reusable, are evicted last.

Prefix hits
    The hit length ``L`` is the largest multiple of ``block_size`` with ``L <= len(prompt) - 1``
    (the last prompt token is always computed, to get its logits) that every group satisfies:
    a full-attention group needs blocks ``[0, L / block_size)`` cached; a group with window
    ``W`` needs the blocks holding positions ``[max(0, L - k - W + 1), L)``, the ones a query at
    position ``L - k`` sees (``k``: the lookahead, below; as llama.cpp's LLAMA_SWA_TYPE_STANDARD
    mask: key ``j`` is visible to query ``p`` when ``p - j < W``). Cached means held by any
    sequence or in the free queue.

Sliding windows
    In a group with window ``W``, once the next query position ``p`` (= ``num_computed_tokens``)
    satisfies ``j <= p - k - W`` for every position ``j`` of a block, the block is released
    (count - 1, to the free queue tail when 0, still cached; several blocks in table order) and
    its table entry becomes a hole, :data:`HOLE` (-1). ``k`` is the sequence's *lookahead*,
    given at ``allocate`` (0 by default; vLLM's num_lookahead_tokens): the window blocks of a
    query ``k`` positions back stay, so that the last ``k`` positions can be truncated and
    computed again. Holes are always a prefix of the table. Blocks a hit leaves out of that
    window are holes from the start.

Truncation
    ``truncate(seq_id, n_keep)`` keeps positions ``[0, n_keep)``; it succeeds whenever
    ``n_keep >= num_computed_tokens - k`` (a window group whose blocks position ``n_keep``
    still sees were released raises ValueError). ``num_computed_tokens`` becomes
    ``min(num_computed_tokens, n_keep)``. Blocks wholly past ``n_keep`` leave the table, last
    block first; one that no other sequence holds loses its hash and goes to the head of the
    free queue (it is taken first, and no prefix hit ever reaches it). The block holding
    position ``n_keep`` when ``n_keep`` is inside a block (the *partial* block), whose slots
    from ``n_keep % block_size`` on will be written again, is unregistered when the sequence
    alone holds it; when others hold it too (a prefix hit), it stays theirs, intact and
    registered, and the sequence gets a fresh block instead, into which the storage copies the
    kept slots (the ``copy_block`` callback). A block another sequence still holds keeps its
    hash: its K/V are intact. So the prefix cache never serves a block whose contents a
    truncation dropped or that will be rewritten.

Sessions
    Save: :meth:`~KVBlockManager.token_ids` and the block tables. Restore:
    ``restore(seq_id, token_ids)`` reserves blocks as if all tokens were computed (reusing
    cached blocks, holes outside the window of position ``len(token_ids)``), the caller writes
    the saved K/V of the non-hole positions from the returned ``n_cached`` on and calls
    ``mark_computed``. To get logits, restore all tokens but the last and compute that one.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np

from edge.kv.block_pool import BlockPool

HOLE = -1  # block table entry of a block released out of the sliding window
_HASH_BYTES = 32
_TOKEN_MAX = 2**31 - 1


class NoFreeBlocks(RuntimeError):
    """A group's free queue cannot supply the blocks a request needs; nothing was changed."""

    def __init__(self, group: int, needed: int, free: int):
        super().__init__(f"KV cache group {group}: {needed} free blocks needed, {free} available")
        self.group, self.needed, self.free = group, needed, free


@dataclass(frozen=True)
class KVGroup:
    """A layer group's pool: ``n_blocks`` blocks; ``window`` in tokens (0 = full attention)."""

    n_blocks: int
    window: int = 0

    def __post_init__(self):
        if self.n_blocks < 1:
            raise ValueError(f"KVGroup: n_blocks must be >= 1, got {self.n_blocks}")
        if self.window < 0:
            raise ValueError(f"KVGroup: window must be >= 0, got {self.window}")


@dataclass(frozen=True)
class GroupStats:
    """Block counts of one group: ``used`` (count > 0) + ``free`` = ``n_blocks``;
    ``cached_free`` of the free blocks still carry a hash (a prefix hit can take them back)."""

    n_blocks: int
    used: int
    free: int
    cached_free: int


@dataclass(frozen=True)
class KVStats:
    """Manager metrics: per-group block counts; prefix-cache queries (successful ``allocate``
    calls), their prompt tokens and the tokens served from the cache."""

    groups: tuple[GroupStats, ...]
    prefix_queries: int
    prefix_query_tokens: int
    prefix_hit_tokens: int


class _Sequence:
    __slots__ = ("token_ids", "num_computed", "tables", "holes", "block_hashes", "arrays", "lookahead")

    def __init__(self, token_ids: list[int], n_groups: int, lookahead: int = 0):
        self.token_ids = token_ids
        self.lookahead = lookahead           # positions a window group keeps blocks back for
        self.num_computed = 0
        self.tables: list[list[int]] = [[] for _ in range(n_groups)]
        self.holes = [0] * n_groups        # leading HOLE entries of each table
        self.block_hashes: list[bytes] = []  # chain over the full blocks of token_ids, a prefix
        self.arrays: list[np.ndarray | None] = [None] * n_groups  # tables as int32, when built


@dataclass
class _Plan:
    """What allocate/restore would do: hit length, and per group the holes, the hit block ids
    and the number of fresh blocks; ``needed[g]`` free-queue entries it consumes."""

    n_cached: int
    holes: list[int]
    hits: list[list[int]]
    n_fresh: list[int]
    needed: list[int]


def _check_lookahead(lookahead, what: str) -> int:
    if not (isinstance(lookahead, (int, np.integer)) and not isinstance(lookahead, bool) and lookahead >= 0):
        raise ValueError(f"{what}: lookahead must be an integer >= 0, got {lookahead!r}")
    return int(lookahead)


def _as_token_ids(token_ids: Sequence[int] | np.ndarray, what: str) -> list[int]:
    arr = np.asarray(token_ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{what}: expected a 1-D sequence of integer token ids, got "
                         f"shape {arr.shape} dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _TOKEN_MAX):
        raise ValueError(f"{what}: token ids must be in [0, {_TOKEN_MAX}], got "
                         f"[{int(arr.min())}, {int(arr.max())}]")
    return arr.tolist()


class KVBlockManager:
    """Block tables, reference counts, LRU free queues and prefix hashes for the paged KV cache
    (module docstring: the rules and the call contract).

    Args:
        groups: one :class:`KVGroup` per layer group (e.g. Gemma 3: a full group and a window
            group); group indices below are positions in this list.
        block_size: token slots per block (>= 1).
        extra_key: bytes naming the model and KV type, mixed into the root of every hash chain.
        forget_out_of_window: when a block leaves a window group's window and no sequence holds
            it, drop its hash and put it first in the free queue, instead of keeping it cached;
            :meth:`pop_forgotten` lists such blocks, so that the storage can release their
            memory (a prefix hit then cannot reach back past a running sequence's window).
    Raises:
        ValueError: no groups, or block_size < 1. TypeError: extra_key is not bytes.
    """

    def __init__(self, groups: Sequence[KVGroup], block_size: int = 16, extra_key: bytes = b"",
                 forget_out_of_window: bool = False):
        if not groups:
            raise ValueError("KVBlockManager: at least one KVGroup is needed")
        if block_size < 1:
            raise ValueError(f"KVBlockManager: block_size must be >= 1, got {block_size}")
        if not isinstance(extra_key, (bytes, bytearray)):
            raise TypeError("KVBlockManager: extra_key must be bytes, got "
                            f"{type(extra_key).__name__}")
        self.block_size = block_size
        self.groups = tuple(groups)
        self._pools = [BlockPool(g.n_blocks, g.window) for g in self.groups]
        self._seqs: dict[Hashable, _Sequence] = {}
        self._root = hashlib.blake2b(
            b"edge.kv.root" + len(extra_key).to_bytes(8, "little") + bytes(extra_key)
            + block_size.to_bytes(4, "little"), digest_size=_HASH_BYTES).digest()
        self._queries = self._query_tokens = self._hit_tokens = 0
        self.forget_out_of_window = forget_out_of_window
        self._forgotten: list[tuple[int, int]] = []

    # ---- sequences -------------------------------------------------------------------------

    def allocate(self, seq_id: Hashable, prompt_ids: Sequence[int] | np.ndarray, lookahead: int = 0) -> int:
        """Start sequence ``seq_id`` with its prompt: take the longest cached prefix and reserve
        fresh blocks for every other prompt position.

        Args:
            lookahead: positions the sequence may take back with :meth:`truncate` (window groups
                keep the blocks for them; module docstring).
        Returns:
            n_cached: prompt tokens whose K/V is already cached (a multiple of block_size,
            < len(prompt_ids)); the caller computes ``prompt_ids[n_cached:]``.
        Raises:
            NoFreeBlocks: a group's free queue is too short (nothing changed).
            ValueError: ``seq_id`` already exists, empty prompt, ids not int32 token ids, or
            lookahead not an integer >= 0.
        """
        tokens = self._new_tokens(seq_id, prompt_ids, "allocate")
        if not tokens:
            raise ValueError("allocate: empty prompt")
        seq = _Sequence(tokens, len(self._pools), _check_lookahead(lookahead, "allocate"))
        plan = self._plan(seq, (len(tokens) - 1) // self.block_size, None, len(tokens))
        self._apply(seq_id, seq, plan)
        self._queries += 1
        self._query_tokens += len(tokens)
        self._hit_tokens += plan.n_cached
        return plan.n_cached

    def restore(self, seq_id: Hashable, token_ids: Sequence[int] | np.ndarray, lookahead: int = 0) -> int:
        """Start sequence ``seq_id`` from a saved session of ``token_ids`` whose K/V the caller
        writes: like :meth:`allocate`, but every full block may hit and window groups keep
        only the blocks a query at position ``len(token_ids)`` sees (the others are holes);
        ``lookahead`` applies to the positions computed after these.

        Returns:
            n_cached: positions already cached; the caller writes the saved K/V of positions
            ``n_cached .. len(token_ids)-1`` that are not holes, then calls
            ``mark_computed(seq_id, len(token_ids) - n_cached)``.
        Raises:
            NoFreeBlocks, ValueError: as :meth:`allocate`.
        """
        tokens = self._new_tokens(seq_id, token_ids, "restore")
        if not tokens:
            raise ValueError("restore: no tokens")
        lookahead = _check_lookahead(lookahead, "restore")
        seq = _Sequence(tokens, len(self._pools))
        plan = self._plan(seq, len(tokens) // self.block_size, len(tokens), len(tokens))
        self._apply(seq_id, seq, plan)
        seq.lookahead = lookahead
        return plan.n_cached

    def can_allocate(self, prompt_ids: Sequence[int] | np.ndarray, reserve_tokens: int = 0,
                     lookahead: int = 0) -> bool:
        """Whether :meth:`allocate` of ``prompt_ids`` (with ``lookahead``) would succeed now with
        blocks to spare for ``reserve_tokens`` more positions (in window groups an upper bound:
        releases during generation are not counted). Changes nothing."""
        tokens = _as_token_ids(prompt_ids, "can_allocate")
        if not tokens or reserve_tokens < 0:
            raise ValueError("can_allocate: empty prompt or negative reserve_tokens")
        seq = _Sequence(tokens, len(self._pools), _check_lookahead(lookahead, "can_allocate"))
        plan = self._plan(seq, (len(tokens) - 1) // self.block_size, None,
                          len(tokens) + reserve_tokens)
        return all(n <= len(p.free_queue) for n, p in zip(plan.needed, self._pools))

    def append_tokens(self, seq_id: Hashable, token_ids: Sequence[int] | np.ndarray) -> None:
        """Add tokens (sampled ones) to a sequence and reserve their slots, before the forward
        that writes their K/V.

        Raises:
            NoFreeBlocks: a group's free queue is too short (nothing changed).
            KeyError: unknown ``seq_id``. ValueError: ids not int32 token ids.
        """
        seq = self._seq(seq_id)
        tokens = _as_token_ids(token_ids, "append_tokens")
        n_blocks = -(-(len(seq.token_ids) + len(tokens)) // self.block_size)
        needed = [n_blocks - len(t) for t in seq.tables]
        self._check_free(needed)
        seq.token_ids.extend(tokens)
        for g, (pool, table, n) in enumerate(zip(self._pools, seq.tables, needed)):
            if n:
                table.extend(pool.take_fresh() for _ in range(n))
                seq.arrays[g] = None

    def mark_computed(self, seq_id: Hashable, n_tokens: int) -> None:
        """Record that the K/V of the next ``n_tokens`` known positions has been written:
        register the hashes of blocks that became full, then release the blocks that fell out
        of a window group's reach of the next query position (minus the lookahead).

        Raises:
            KeyError: unknown ``seq_id``.
            ValueError: ``n_tokens`` < 0 or more than the known, uncomputed tokens.
        """
        seq = self._seq(seq_id)
        end = seq.num_computed + n_tokens
        if n_tokens < 0 or end > len(seq.token_ids):
            raise ValueError(f"mark_computed: {n_tokens} tokens, but sequence {seq_id!r} has "
                             f"{len(seq.token_ids) - seq.num_computed} uncomputed")
        bs = self.block_size
        first_full, end_full = seq.num_computed // bs, end // bs
        hashes = self._block_hashes(seq, end_full)
        for g, pool in enumerate(self._pools):
            table = seq.tables[g]
            for k in range(first_full, end_full):
                if table[k] != HOLE:
                    pool.register(table[k], hashes[k])
            for k in range(seq.holes[g], pool.first_visible_block(end, bs, seq.lookahead)):
                pool.release(table[k])
                if self.forget_out_of_window and pool.blocks[table[k]].ref_count == 0:
                    pool.forget(table[k])
                    self._forgotten.append((g, table[k]))
                table[k] = HOLE
                seq.holes[g] = k + 1
                seq.arrays[g] = None
        seq.num_computed = end

    def free(self, seq_id: Hashable) -> None:
        """End a sequence: release its blocks, last block first (they stay cached).

        Raises:
            KeyError: unknown ``seq_id``.
        """
        seq = self._seq(seq_id)
        for pool, table in zip(self._pools, seq.tables):
            for block_id in reversed(table):
                if block_id != HOLE:
                    pool.release(block_id)
        del self._seqs[seq_id]

    def truncate(self, seq_id: Hashable, n_keep: int,
                 copy_block: Callable[[int, int, int, int], None] | None = None) -> None:
        """Drop the tokens of a sequence from position ``n_keep`` on, computed or not (module
        docstring, Truncation): the caller then appends and computes other tokens there.

        Args:
            n_keep: positions kept, ``0 <= n_keep <= num_tokens``.
            copy_block: ``copy_block(group, src, dst, n_slots)`` copies the K/V of the first
                ``n_slots`` slots of block ``src`` to block ``dst`` of ``group``, for a partial
                block other sequences hold too (required then).
        Raises:
            KeyError: unknown ``seq_id``.
            ValueError: ``n_keep`` out of range, or a window group has released blocks that a
                query at ``min(n_keep, num_computed_tokens)`` sees (more than the lookahead
                back); no copy_block for a shared partial block.
            NoFreeBlocks: no fresh block for a copy.
            Whatever copy_block raises. In every case the sequence is unchanged (a cached free
            block taken for a copy stays evicted).
        """
        seq = self._seq(seq_id)
        n = len(seq.token_ids)
        if not (isinstance(n_keep, (int, np.integer)) and 0 <= n_keep <= n):
            raise ValueError(f"truncate: n_keep must be an integer in [0, {n}] (the tokens of sequence "
                             f"{seq_id!r}), got {n_keep!r}")
        n_keep = int(n_keep)
        if n_keep == n:
            return
        bs = self.block_size
        query = min(n_keep, seq.num_computed)
        partial = n_keep // bs if n_keep % bs else None     # the block kept in part
        shared = []                                          # groups whose partial block others hold
        for g, pool in enumerate(self._pools):
            if seq.holes[g] > pool.first_visible_block(query, bs):
                raise ValueError(f"truncate: sequence {seq_id!r} cannot go back to {n_keep} tokens: group {g}'s "
                                 f"window blocks for that position were released (lookahead {seq.lookahead})")
            if partial is not None and pool.blocks[seq.tables[g][partial]].ref_count > 1:
                shared.append(g)
        if shared and copy_block is None:
            raise ValueError("truncate: the partial block is shared; a copy_block callback is needed")
        self._check_free([int(g in shared) for g in range(len(self._pools))])
        fresh = {g: self._pools[g].take_fresh() for g in shared}
        try:
            for g, dst in fresh.items():
                copy_block(g, seq.tables[g][partial], dst, n_keep % bs)
        except BaseException:
            for g, dst in fresh.items():
                self._pools[g].release(dst)
                self._pools[g].forget(dst)
            raise
        n_blocks = -(-n_keep // bs)
        for g, pool in enumerate(self._pools):
            table = seq.tables[g]
            if g in fresh:
                pool.release(table[partial])
                table[partial] = fresh[g]
            elif partial is not None:
                pool.unregister(table[partial])
            for block_id in reversed(table[n_blocks:]):    # the first dropped ends at the head
                pool.release(block_id)
                if pool.blocks[block_id].ref_count == 0:
                    pool.forget(block_id)
            del table[n_blocks:]
            seq.arrays[g] = None
        del seq.token_ids[n_keep:]
        del seq.block_hashes[n_keep // bs:]
        seq.num_computed = min(seq.num_computed, n_keep)

    def forget_free_blocks(self, group: int, block_ids: Sequence[int]) -> None:
        """Drop what free blocks of ``group`` hold (their storage was given back): their hashes
        go, so no prefix hit reaches them, and they move to the head of the free queue.

        Raises:
            ValueError: a block a sequence holds.
        """
        pool = self._pools[group]
        for block_id in block_ids:
            if pool.blocks[block_id].ref_count:
                raise ValueError(f"forget_free_blocks: block {block_id} of group {group} is in use")
            pool.forget(block_id)

    def pop_forgotten(self) -> list[tuple[int, int]]:
        """(group, block id) of the blocks forgotten since the last call (forget_out_of_window)."""
        out, self._forgotten = self._forgotten, []
        return out

    # ---- views -----------------------------------------------------------------------------

    def block_table(self, seq_id: Hashable, group: int = 0) -> np.ndarray:
        """int32[ceil(num_tokens / block_size)] block ids of a sequence in ``group``, HOLE (-1)
        for blocks released out of the window; read-only, never changed afterwards (a table
        change builds a new array). Raises KeyError for an unknown ``seq_id``."""
        return self._table_array(self._seq(seq_id), group)

    def slots(self, seq_id: Hashable, group: int, start: int,
              n: int) -> tuple[np.ndarray, np.ndarray]:
        """Where positions ``start .. start+n-1`` of a sequence live in ``group``.

        Returns:
            (block_ids, offsets): int32[n] each; slot = offsets[i] of block block_ids[i].
        Raises:
            KeyError: unknown ``seq_id``.
            ValueError: a position is outside ``[0, num_tokens)`` or in a hole.
        """
        seq = self._seq(seq_id)
        if start < 0 or n < 0 or start + n > len(seq.token_ids):
            raise ValueError(f"slots: positions {start}..{start + n - 1} outside the "
                             f"{len(seq.token_ids)} known tokens of sequence {seq_id!r}")
        positions = np.arange(start, start + n, dtype=np.int64)
        block_ids = self._table_array(seq, group)[positions // self.block_size]
        if (block_ids == HOLE).any():
            raise ValueError(f"slots: positions from {start} reach blocks of group {group} "
                             f"released out of the window (sequence {seq_id!r})")
        return block_ids, (positions % self.block_size).astype(np.int32)

    def token_ids(self, seq_id: Hashable) -> np.ndarray:
        """int32[num_tokens] known token ids of a sequence (a copy)."""
        return np.array(self._seq(seq_id).token_ids, dtype=np.int32)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Known tokens of a sequence (all have slots)."""
        return len(self._seq(seq_id).token_ids)

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        """Tokens of a sequence whose K/V is written (cached hit + marked computed)."""
        return self._seq(seq_id).num_computed

    def num_free_blocks(self, group: int = 0) -> int:
        """Blocks in ``group``'s free queue (including cached free blocks)."""
        return len(self._pools[group].free_queue)

    def free_queue(self, group: int = 0) -> list[int]:
        """Block ids of ``group``'s free queue in eviction order (next taken first)."""
        return list(self._pools[group].free_queue)

    def ref_counts(self, group: int = 0) -> np.ndarray:
        """int32[n_blocks] reference counts of ``group``'s blocks."""
        return np.array([b.ref_count for b in self._pools[group].blocks], dtype=np.int32)

    def block_hash(self, group: int, block_id: int) -> bytes | None:
        """The registered hash of a block (None if the block is not registered)."""
        return self._pools[group].blocks[block_id].block_hash

    def cached_blocks(self, group: int = 0) -> dict[bytes, int]:
        """``group``'s prefix hash map: block hash -> block id (a copy)."""
        return dict(self._pools[group].cached)

    def stats(self) -> KVStats:
        """Block counts per group and prefix-cache counters."""
        groups = tuple(
            GroupStats(len(p.blocks), len(p.blocks) - len(p.free_queue), len(p.free_queue),
                       sum(p.blocks[i].block_hash is not None for i in p.free_queue))
            for p in self._pools)
        return KVStats(groups, self._queries, self._query_tokens, self._hit_tokens)

    # ---- internals -------------------------------------------------------------------------

    def _seq(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"KV cache: unknown sequence {seq_id!r}") from None

    @staticmethod
    def _table_array(seq: _Sequence, group: int) -> np.ndarray:
        arr = seq.arrays[group]
        if arr is None:
            arr = seq.arrays[group] = np.array(seq.tables[group], dtype=np.int32)
            arr.flags.writeable = False
        return arr

    def _new_tokens(self, seq_id: Hashable, token_ids, what: str) -> list[int]:
        if seq_id in self._seqs:
            raise ValueError(f"{what}: sequence {seq_id!r} already exists")
        return _as_token_ids(token_ids, what)

    def _block_hashes(self, seq: _Sequence, n_blocks: int) -> list[bytes]:
        """The hash chain over the first ``n_blocks`` (full) blocks of ``seq.token_ids``."""
        hashes, bs = seq.block_hashes, self.block_size
        first = len(hashes)
        if n_blocks > first:
            data = np.asarray(seq.token_ids[first * bs:n_blocks * bs], dtype="<i4").tobytes()
            step = 4 * bs  # bytes of one block's int32 token ids
            h = hashes[-1] if hashes else self._root
            for i in range(0, len(data), step):
                h = hashlib.blake2b(h + data[i:i + step], digest_size=_HASH_BYTES).digest()
                hashes.append(h)
        return hashes

    def _plan(self, seq: _Sequence, max_hit_blocks: int, query: int | None, end: int) -> _Plan:
        """Plan a new sequence: hit at most ``max_hit_blocks`` blocks, window groups seen from
        position ``query`` (None: from the hit length), slots for positions ``[0, end)``."""
        bs = self.block_size
        hashes = self._block_hashes(seq, max_hit_blocks)
        # run[g][k]: consecutive cached blocks of group g ending at block k
        runs = []
        for pool in self._pools:
            run, r = [], 0
            for h in hashes:
                r = r + 1 if h in pool.cached else 0
                run.append(r)
            runs.append(run)
        n_hit = max_hit_blocks
        while n_hit > 0 and not self._hits_cover(runs, n_hit, query, seq.lookahead):
            n_hit -= 1
        q = n_hit * bs if query is None else query
        n_blocks = -(-end // bs)
        plan = _Plan(n_hit * bs, [], [], [], [])
        for pool in self._pools:
            first = pool.first_visible_block(q, bs, seq.lookahead)
            hits = [pool.cached[hashes[k]] for k in range(first, n_hit)]
            n_fresh = n_blocks - max(first, n_hit)
            plan.holes.append(first)
            plan.hits.append(hits)
            plan.n_fresh.append(n_fresh)
            plan.needed.append(n_fresh + sum(pool.blocks[b].ref_count == 0 for b in hits))
        return plan

    def _hits_cover(self, runs: list[list[int]], n_hit: int, query: int | None, lookahead: int) -> bool:
        """Whether every group has the cached blocks a hit of ``n_hit`` blocks needs."""
        q = n_hit * self.block_size if query is None else query
        for run, pool in zip(runs, self._pools):
            first = pool.first_visible_block(q, self.block_size, lookahead)
            if first < n_hit and run[n_hit - 1] < n_hit - first:
                return False
        return True

    def _check_free(self, needed: list[int]) -> None:
        for g, (n, pool) in enumerate(zip(needed, self._pools)):
            if n > len(pool.free_queue):
                raise NoFreeBlocks(g, n, len(pool.free_queue))

    def _apply(self, seq_id: Hashable, seq: _Sequence, plan: _Plan) -> None:
        self._check_free(plan.needed)
        for g, pool in enumerate(self._pools):
            for block_id in plan.hits[g]:
                pool.take_cached(block_id)
            seq.tables[g] = ([HOLE] * plan.holes[g] + plan.hits[g]
                             + [pool.take_fresh() for _ in range(plan.n_fresh[g])])
            seq.holes[g] = plan.holes[g]
        seq.num_computed = plan.n_cached
        self._seqs[seq_id] = seq
