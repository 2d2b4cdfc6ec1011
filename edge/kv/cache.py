"""The paged KV cache of one model instance: K/V block pools in a memory map, and the block
manager (edge.kv.blocks) that hands their blocks to sequences.

Layout: layer ``l`` has a K pool and a V pool of its layer group's blocks,
``[n_blocks, block_size, n_head_kv, row]``; a row holds one head's values of one token in the
KV type: f16 (uint16 bits, row = head_dim), f32 (row = head_dim) or q8_0 (uint8, head_dim / 32
blocks of a f16 scale and 32 int8, row = head_dim / 32 * 34 bytes: ggml's block_q8_0). Layers
with a sliding window (Gemma 3's local layers) form group 1, with their own blocks, released
as they leave the window (their pages given back to the system, so a long context costs the
local layers only their window); the others form group 0 (full attention).

The pools live in one memory map: a file under ``$EDGE_HOME/kv/`` (unlinked as soon as it is
mapped, so nothing is left behind; the kernel can write cold pages there instead of keeping
them in RAM) or anonymous memory. Either way a page costs RAM only once a token's K/V is
written there, so a large n_ctx reserves address space, not memory. A page of the file gets
its disk blocks before the first K/V is written to it: :meth:`PagedKVCache.reserve` (called by
:meth:`~PagedKVCache.prepare` for every forward) allocates them (posix_fallocate) for the
blocks a forward is about to write (on a full file system, after taking the space of free
blocks, whose cached prefixes are dropped), so a full file system is a :class:`KVNoSpace`
error before the forward, never a page that cannot be written (SIGBUS). When the file cannot be
made (a read-only ``$EDGE_HOME``) or its file system cannot allocate ahead, the pools are
anonymous memory.

A sequence is a slot ``0 .. n_seq-1``. :meth:`PagedKVCache.new_sequence` reuses the longest
cached prefix (prefix caching, see edge.kv.blocks) and reserves blocks for the prompt;
:meth:`append` reserves the next sampled token's slot; the model's forward pass writes K/V
through the block tables (:meth:`prepare` / :meth:`commit`); :meth:`truncate` takes positions
back (rejected draft tokens; a sequence made with a lookahead of k keeps the window blocks to
take back its last k positions); :meth:`free` ends a sequence (its full blocks stay cached
until evicted in LRU order).
"""
from __future__ import annotations

import errno
import io
import mmap
import os
import uuid
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from edge.kv.blocks import HOLE, KVBlockManager, KVGroup
from kernels_cpu.ggml_types import TYPES

KV_TYPES = ("f16", "f32", "q8_0")
_DTYPE = {"f16": np.uint16, "f32": np.float32, "q8_0": np.uint8}
_ALIGN = 4096


class NoFreeSlot(RuntimeError):
    """Every sequence slot of the KV cache is in use (n_seq sequences are running)."""


class KVNoSpace(RuntimeError):
    """The file system of the KV pool file cannot give disk space to the blocks a forward is
    about to write (no space left, or the disk quota reached); nothing was written.

    Attributes: folder (the pool's folder), needed and free (bytes), reason (the system's).
    """

    def __init__(self, folder: Path, needed: int, free: int, reason: str):
        super().__init__(f"no space for the KV cache in {folder} ({reason}): the next step needs "
                         f"{_human_bytes(needed)} more, {_human_bytes(free)} are free; free some space there or "
                         "set EDGE_HOME to a folder on a file system with room")
        self.folder, self.needed, self.free, self.reason = folder, needed, free, reason


def kv_row(kv_type: str, head_dim: int) -> int:
    """Elements of the pool dtype per head row of one token (ValueError for a bad type or a
    head_dim q8_0 cannot hold)."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"unknown KV cache type {kv_type!r} (supported: {', '.join(KV_TYPES)})")
    row = TYPES[GGMLQuantizationType[kv_type.upper()]]
    if row.quantized:  # rows of blocks, in bytes
        if head_dim % row.block_size:
            raise ValueError(f"KV cache type {kv_type} needs head_dim divisible by {row.block_size}, got {head_dim}")
        return row.row_bytes(head_dim)
    return head_dim


def kv_bytes_per_token(args, type_k: str = "f16", type_v: str = "f16") -> int:
    """Bytes of K and V one token takes over all layers."""
    size = np.dtype(_DTYPE[type_k]).itemsize * kv_row(type_k, args.head_dim) + \
        np.dtype(_DTYPE[type_v]).itemsize * kv_row(type_v, args.head_dim_v)
    return args.n_layer * args.n_head_kv * size


class PagedKVCache:
    """Paged KV cache: block pools per layer group plus their block manager.

    Args:
        args: the model's ModelArgs (n_layer, n_head_kv, head_dim(_v), swa_layers, sliding_window).
        n_ctx: most positions one sequence may hold.
        n_seq: most sequences at once (slots).
        block_size: token positions per block (default 16).
        type_k, type_v: "f16" (default), "f32" or "q8_0".
        model_key: bytes naming the model (so prefix hashes of other models never match).
        storage: "file" (a memory-mapped file under ``home``/kv, the default; anonymous memory
            when that file cannot be made or its file system cannot allocate ahead) or "anon".
            The attribute ``storage`` says which the pools got.
        home: the edge data directory (for storage="file").
    Raises ValueError for bad sizes or types.
    """

    def __init__(self, args, n_ctx: int, n_seq: int = 1, block_size: int = 16, type_k: str = "f16",
                 type_v: str = "f16", model_key: bytes = b"", storage: str = "file", home: Path | None = None):
        if n_ctx < 1 or n_seq < 1 or block_size < 1:
            raise ValueError(f"KV cache needs n_ctx, n_seq and block_size >= 1, got {n_ctx}, {n_seq}, {block_size}")
        if storage not in ("file", "anon"):
            raise ValueError(f"KV cache storage must be 'file' or 'anon', got {storage!r}")
        self.args, self.n_ctx, self.n_seq, self.block_size = args, n_ctx, n_seq, block_size
        self.type_k, self.type_v = type_k, type_v
        row_k, row_v = kv_row(type_k, args.head_dim), kv_row(type_v, args.head_dim_v)
        window = args.sliding_window if any(args.swa_layers) else 0
        self.layer_group = [1 if (window and swa) else 0 for swa in args.swa_layers]
        n_blocks = n_seq * -(-n_ctx // block_size)
        _check_fits_memory(n_blocks * block_size * kv_bytes_per_token(args, type_k, type_v), n_ctx, n_seq)
        groups = [KVGroup(n_blocks, window=0)]
        if 1 in self.layer_group:
            groups.append(KVGroup(n_blocks, window=window))
        self.manager = KVBlockManager(groups, block_size=block_size,
                                      extra_key=bytes(model_key) + f"|k={type_k}|v={type_v}".encode(),
                                      forget_out_of_window=True)
        shapes = []
        for _ in range(args.n_layer):
            shapes.append(((n_blocks, block_size, args.n_head_kv, row_k), _DTYPE[type_k]))
            shapes.append(((n_blocks, block_size, args.n_head_kv, row_v), _DTYPE[type_v]))
        sizes = [-(-int(np.prod(s)) * np.dtype(d).itemsize // _ALIGN) * _ALIGN for s, d in shapes]
        self._map, self._file, self._folder = _map_memory(sum(sizes), storage, home)
        self.storage = "anon" if self._file is None else "file"
        arrays, offset = [], 0
        self._spans: list[list[tuple[int, int]]] = [[] for _ in groups]   # per group: (offset, bytes per block)
        for i, ((shape, dtype), size) in enumerate(zip(shapes, sizes)):
            arrays.append(np.frombuffer(self._map, dtype=dtype, count=int(np.prod(shape)), offset=offset).reshape(shape))
            self._spans[self.layer_group[i // 2]].append((offset, arrays[-1][0].nbytes))
            offset += size
        self.k, self.v = arrays[0::2], arrays[1::2]
        self.nbytes = sum(sizes)
        # per group: blocks whose bytes in the pool file have disk blocks (file storage only)
        self._backed = None if self._file is None else [np.zeros(n_blocks, bool) for _ in groups]
        self.pos = np.zeros(n_seq, np.int64)            # computed positions per slot
        self._free_slots = list(range(n_seq - 1, -1, -1))
        self._tables: list[np.ndarray] = []   # per group, built by prepare() for one forward

    # ---- sequences -------------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.args, self.type_k, self.type_v)

    def new_sequence(self, prompt_ids, lookahead: int = 0) -> tuple[int, int]:
        """Start a sequence with its prompt: returns (slot, n_cached), the prompt tokens whose
        K/V the prefix cache already holds (the caller computes prompt_ids[n_cached:]).
        ``lookahead``: how many of its last computed positions :meth:`truncate` may take back
        (edge.kv.blocks: sliding-window layers keep their blocks that long).

        Raises ValueError (empty prompt or longer than n_ctx, bad lookahead), NoFreeSlot or
        NoFreeBlocks (nothing changed)."""
        if len(prompt_ids) > self.n_ctx:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens but n_ctx is {self.n_ctx}")
        slot = self._next_slot()
        n_cached = self.manager.allocate(slot, prompt_ids, lookahead)
        self._free_slots.pop()
        self.pos[slot] = n_cached
        return slot, n_cached

    def append(self, slot: int, token_ids) -> None:
        """Reserve positions for tokens to be computed next (sampled tokens). Raises
        ValueError past n_ctx, NoFreeBlocks when the pool is full (nothing changed)."""
        n = self.manager.num_tokens(slot) + len(token_ids)
        if n > self.n_ctx:
            raise ValueError(f"context full: sequence {slot} would hold {n} tokens, n_ctx is {self.n_ctx}")
        self.manager.append_tokens(slot, token_ids)

    def truncate(self, slot: int, n_keep: int) -> None:
        """Keep the first ``n_keep`` positions of the sequence in ``slot`` and drop the rest,
        computed or reserved (edge.kv.blocks.KVBlockManager.truncate: dropped blocks lose their
        prefix hashes; a partial block other sequences share is copied first). The caller then
        appends and computes other tokens from ``n_keep`` on.

        Raises ValueError (n_keep outside [0, known tokens], or further back than the
        sequence's lookahead allows in a sliding-window layer), KVNoSpace (no disk space for
        the copy); the sequence is then unchanged."""
        self.manager.truncate(slot, n_keep, self._copy_block)
        self.pos[slot] = min(int(self.pos[slot]), n_keep)

    def _copy_block(self, g: int, src: int, dst: int, n_slots: int) -> None:
        """Copy the K/V of the first n_slots slots of block src to block dst in every layer of
        group g (dst gets its disk space first)."""
        if self._backed is not None and not self._backed[g][dst]:
            self._back_blocks(g, np.array([dst]))
        for il, group in enumerate(self.layer_group):
            if group == g:
                self.k[il][dst, :n_slots] = self.k[il][src, :n_slots]
                self.v[il][dst, :n_slots] = self.v[il][src, :n_slots]

    def _next_slot(self) -> int:
        """The slot the next sequence takes (taken once the manager accepts it)."""
        if not self._free_slots:
            raise NoFreeSlot(f"all {self.n_seq} sequence slots of the KV cache are in use")
        return self._free_slots[-1]

    def free(self, slot: int) -> None:
        """End the sequence in ``slot``; its full blocks stay cached."""
        self.manager.free(slot)
        self.pos[slot] = 0
        self._free_slots.append(slot)

    def num_tokens(self, slot: int) -> int:
        """Positions reserved (known tokens) of the sequence in ``slot``."""
        return self.manager.num_tokens(slot)

    def first_position(self, il: int, n_tokens: int) -> int:
        """First position layer il's K/V must hold for a query at position n_tokens (0 for
        full attention; the window's first cell for a sliding-window layer)."""
        if self.layer_group[il] == 0:
            return 0
        return max(0, n_tokens - self.manager.groups[1].window + 1)

    def export_sequence(self, slot: int) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """The computed state of a sequence, to save it: (token ids int32[n], per layer the K
        rows and the V rows of positions first_position(l, n) .. n-1, arrays [m, n_head_kv, row]
        in the pool dtype)."""
        n = int(self.pos[slot])
        tokens = self.manager.token_ids(slot)[:n]
        ks, vs = [], []
        for il in range(self.args.n_layer):
            lo = self.first_position(il, n)
            blocks, offsets = self.manager.slots(slot, self.layer_group[il], lo, n - lo)
            ks.append(self.k[il][blocks, offsets])
            vs.append(self.v[il][blocks, offsets])
        return tokens, ks, vs

    def import_sequence(self, tokens, ks: list[np.ndarray], vs: list[np.ndarray], lookahead: int = 0) -> int:
        """Start a sequence from a saved state (export_sequence's arrays): returns its slot,
        with all len(tokens) positions computed (blocks the prefix cache holds are reused, the
        rest written); ``lookahead`` as :meth:`new_sequence`'s, for positions after these. Raises ValueError for arrays of the wrong shape or type, NoFreeSlot,
        NoFreeBlocks or KVNoSpace (nothing changed)."""
        n = len(tokens)
        if n > self.n_ctx:
            raise ValueError(f"the session holds {n} tokens but n_ctx is {self.n_ctx}")
        for il in range(self.args.n_layer):
            want = n - self.first_position(il, n)
            for a, pool, what in ((ks[il], self.k[il], "K"), (vs[il], self.v[il], "V")):
                if a.dtype != pool.dtype or a.shape != (want,) + pool.shape[2:]:
                    raise ValueError(f"layer {il} {what}: expected {pool.dtype}{[want, *pool.shape[2:]]}, "
                                     f"got {a.dtype}{list(a.shape)}")
        slot = self._next_slot()
        n_cached = self.manager.restore(slot, tokens, lookahead)
        self._free_slots.pop()
        try:
            for g in range(len(self.manager.groups)):
                il = self.layer_group.index(g)
                self._back_positions(slot, g, max(self.first_position(il, n), n_cached), n)
        except KVNoSpace:
            self.free(slot)
            raise
        for il in range(self.args.n_layer):
            lo = self.first_position(il, n)
            start = max(lo, n_cached)
            blocks, offsets = self.manager.slots(slot, self.layer_group[il], start, n - start)
            self.k[il][blocks, offsets] = ks[il][start - lo :]
            self.v[il][blocks, offsets] = vs[il][start - lo :]
        self.manager.mark_computed(slot, n - n_cached)
        self.pos[slot] = n
        return slot

    # ---- the forward pass ------------------------------------------------------------------

    def reserve(self, slot: int, n_tokens: int) -> None:
        """Give disk space to the next ``n_tokens`` positions of ``slot`` (from pos[slot], known
        tokens) in every layer's pools before they are written: posix_fallocate of the blocks
        holding them that have none yet. Nothing to do for anonymous memory or blocks already
        backed (a decode step within a block costs a table lookup). When the file system is
        full, the free blocks give their space back first (their cached prefixes are dropped).

        Raises KVNoSpace (nothing was written; the blocks backed before stay so)."""
        if self._backed is None or n_tokens <= 0:
            return
        start = int(self.pos[slot])
        for g in range(len(self.manager.groups)):
            self._back_positions(slot, g, start, start + n_tokens)

    def _back_positions(self, slot: int, g: int, start: int, end: int) -> None:
        """Back the blocks of group g holding positions start .. end-1 of ``slot``."""
        if self._backed is None or end <= start:
            return
        bs, backed = self.block_size, self._backed[g]
        table = self.manager.block_table(slot, g)
        first, last = start // bs, (end - 1) // bs
        if first == last:                        # a decode step: one block, mostly backed already
            b = int(table[first])
            if b == HOLE or backed[b]:
                return
            new = np.array([b])
        else:
            blocks = table[first : last + 1]          # distinct: a table never holds a block twice
            blocks = blocks[blocks != HOLE]
            new = np.sort(blocks[~backed[blocks]])
            if not new.size:
                return
        self._back_blocks(g, new)

    def _back_blocks(self, g: int, new: np.ndarray) -> None:
        """Give disk space to blocks ``new`` (sorted, not yet backed) of group g's pools, taking
        the space of free blocks when the file system is full. Raises KVNoSpace."""
        if self._backed is None:
            return
        runs = _runs(new)
        page, size = mmap.PAGESIZE, len(self._map)
        ranges = []
        for offset, block_bytes in self._spans[g]:
            for a, b in runs:     # whole pages: a page is written back whole
                ranges.append(((offset + a * block_bytes) // page * page,
                               min(size, -(-(offset + b * block_bytes) // page) * page)))
        for attempt in range(2):
            try:
                for lo, hi in ranges:
                    os.posix_fallocate(self._file.fileno(), lo, hi - lo)
                break
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                self._punch(g, runs)   # give back what this call took: those blocks hold nothing yet
                if attempt == 0 and self._reclaim():
                    continue
                st = os.fstatvfs(self._file.fileno())
                needed = new.size * sum(block_bytes for _, block_bytes in self._spans[g])
                raise KVNoSpace(self._folder, needed, st.f_bavail * st.f_frsize, os.strerror(e.errno)) from None
        self._backed[g][new] = True

    def _reclaim(self) -> bool:
        """Give back the disk space of the free blocks that have some (cached prefixes and what
        failed requests wrote: their hashes are dropped); returns whether there were any."""
        found = False
        for g in range(len(self.manager.groups)):
            ids = np.array([b for b in self.manager.free_queue(g) if self._backed[g][b]], np.int64)
            if ids.size:
                found = True
                self.manager.forget_free_blocks(g, ids.tolist())
                self._backed[g][ids] = False
                self._punch(g, _runs(np.sort(ids)))
        return found

    def prepare(self, runs: np.ndarray, lengths: np.ndarray) -> None:
        """Before a forward that writes ``lengths[i]`` positions of sequence ``runs[i]`` from
        pos[runs[i]]: check that they are reserved, give them disk space (:meth:`reserve`) and
        build the block tables. Raises ValueError (positions not reserved) or KVNoSpace."""
        for s, n in zip(runs.tolist(), lengths.tolist()):
            reserved = self.manager.num_tokens(s)
            if self.pos[s] + n > reserved:
                raise ValueError(f"sequence {s}: positions {self.pos[s]}..{self.pos[s] + n - 1} are not "
                                 f"reserved ({reserved} known tokens); call append() first")
        for s, n in zip(runs.tolist(), lengths.tolist()):
            self.reserve(s, n)
        self._tables = []
        for g in range(len(self.manager.groups)):
            rows = {s: self.manager.block_table(s, g) for s in runs.tolist()}
            width = max(len(t) for t in rows.values())
            tables = np.full((self.n_seq, width), HOLE, np.int32)
            for s, t in rows.items():
                tables[s, : len(t)] = t
            self._tables.append(tables)

    def layer_tables(self, il: int) -> np.ndarray:
        """Block tables int32[n_seq, max_blocks] of layer il's group, for the current forward."""
        return self._tables[self.layer_group[il]]

    def commit(self, runs: np.ndarray, lengths: np.ndarray) -> None:
        """After the forward: the positions are computed (their full blocks become cached)."""
        for s, n in zip(runs.tolist(), lengths.tolist()):
            self.manager.mark_computed(s, n)
            self.pos[s] += n
        self._tables = []
        self._release_memory(self.manager.pop_forgotten())

    def _release_memory(self, blocks: list[tuple[int, int]]) -> None:
        """Give the pages of blocks that left the window back to the system: they read as
        zeros when written again, after :meth:`reserve` backs them again."""
        for g in range(len(self.manager.groups)):
            ids = np.array(sorted({b for gb, b in blocks if gb == g}), np.int64)
            if ids.size:
                if self._backed is not None:
                    self._backed[g][ids] = False
                self._punch(g, _runs(ids))

    def _punch(self, g: int, runs: list[tuple[int, int]]) -> None:
        """MADV_REMOVE the pages wholly inside blocks ``[a, b)`` of each run in group g's pools
        (it frees shared memory and file pages with their disk blocks; pages shared with a
        neighbouring block stay). Nothing on a system or file system that cannot."""
        advice = getattr(mmap, "MADV_REMOVE", None)
        if advice is None:
            return
        page = mmap.PAGESIZE
        for offset, block_bytes in self._spans[g]:
            for a, b in runs:
                lo = -(-(offset + a * block_bytes) // page) * page
                hi = (offset + b * block_bytes) // page * page
                if hi > lo:
                    try:
                        self._map.madvise(advice, lo, hi - lo)
                    except OSError:  # a file system without hole punching: keep the pages
                        return

    def close(self) -> None:
        """Release the memory map and the pool file (the arrays must not be used afterwards)."""
        self.k = self.v = []
        try:
            self._map.close()
        except BufferError:  # views still held elsewhere: the map goes with the last of them
            pass
        if self._file is not None:
            self._file.close()
            self._backed = None


def _check_fits_memory(full_bytes: int, n_ctx: int, n_seq: int) -> None:
    """Refuse a KV cache that could never be filled: one larger than the machine's RAM.
    (Unused pages cost nothing, but the block bookkeeping grows with n_ctx, and a context
    that cannot be held is a mistake better reported at once.)"""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    if full_bytes > ram:
        seqs = f" x {n_seq} sequences" if n_seq > 1 else ""
        raise ValueError(f"a KV cache of {n_ctx} positions{seqs} needs {full_bytes / 2**30:.1f} GiB when full, "
                         f"more than this machine's {ram / 2**30:.1f} GiB of RAM; lower -c/--ctx-size"
                         + (" or the number of sequences" if n_seq > 1 else ""))


def _map_memory(size: int, storage: str, home: Path | None) -> tuple[mmap.mmap, io.FileIO | None, Path | None]:
    """A zero-filled shared mapping of ``size`` bytes: (map, pool file, its folder). With
    storage "file", a sparse file under home/kv, unlinked at once (it lives as long as the
    mapping and the returned file object); anonymous memory (file and folder None) for "anon"
    or when that file cannot be made (read-only or missing folder, no permission) or its file
    system cannot allocate ahead (posix_fallocate unsupported)."""
    size = max(size, _ALIGN)
    if storage == "file":
        try:
            pool, kv_dir = _pool_file(size, home)
        except OSError:
            pass
        else:
            try:
                return mmap.mmap(pool.fileno(), size), pool, kv_dir
            except BaseException:
                pool.close()
                raise
    return mmap.mmap(-1, size), None, None


def _pool_file(size: int, home: Path | None) -> tuple[io.FileIO, Path]:
    """A new unlinked file of ``size`` bytes (a hole) under home/kv whose file system can
    allocate its blocks ahead (probed on its first page). Raises OSError otherwise."""
    if home is None:
        from edge.files import edge_home
        home = edge_home()
    kv_dir = Path(home) / "kv"
    kv_dir.mkdir(parents=True, exist_ok=True)
    path = kv_dir / f"pool-{os.getpid()}-{uuid.uuid4().hex[:8]}.kv"
    pool = io.FileIO(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), "r+")
    try:
        os.unlink(path)
        os.ftruncate(pool.fileno(), size)
        try:
            os.posix_fallocate(pool.fileno(), 0, min(size, mmap.PAGESIZE))
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):   # full now: reserve() says so when it matters
                pass
            else:
                raise
    except BaseException:
        pool.close()
        raise
    return pool, kv_dir


def _runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """Sorted unique block ids as runs of consecutive ids ``[(first, end), ...]``."""
    ids = ids.tolist()
    cuts = [i for i in range(1, len(ids)) if ids[i] != ids[i - 1] + 1]
    return [(ids[a], ids[b - 1] + 1) for a, b in zip([0, *cuts], [*cuts, len(ids)])]


def _human_bytes(n: int) -> str:
    """``n`` bytes as B, KiB, MiB or GiB with one decimal (KiB and up)."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
