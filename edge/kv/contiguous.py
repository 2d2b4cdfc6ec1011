"""A contiguous KV cache: one block of n_ctx cells per sequence slot (the reference for the
paged cache of edge.kv.cache, and the cache of perplexity runs)."""
from __future__ import annotations

import numpy as np

DEFAULT_TYPE = "f16"


class KVCache:
    """A contiguous KV cache with ``n_seq`` sequence slots.

    k[l], v[l]: uint16[n_seq, n_ctx, n_head_kv, head_dim] (f16 bits; float32 for kv_type
    "f32"); cell j of slot s holds position j of sequence s. ``pos`` int64[n_seq] counts the
    positions each slot has filled. Memory comes from np.zeros, so pages that are never written
    cost no RAM.

    Args:
        args: the model's ModelArgs (n_layer, n_head_kv, head_dim, head_dim_v).
        n_ctx: positions per slot. n_seq: slots. kv_type: "f16" (default) or "f32", for K and V.
    Raises ValueError for sizes below 1 or another type.
    """

    def __init__(self, args, n_ctx: int, n_seq: int = 1, kv_type: str = DEFAULT_TYPE):
        if n_ctx < 1 or n_seq < 1:
            raise ValueError(f"a KV cache needs n_ctx >= 1 and n_seq >= 1, got {n_ctx}, {n_seq}")
        if kv_type not in ("f16", "f32"):
            raise ValueError(f"the contiguous KV cache holds f16 or f32, not {kv_type!r}")
        self.n_ctx, self.n_seq = n_ctx, n_seq
        self.type_k = self.type_v = kv_type
        dt = np.uint16 if kv_type == "f16" else np.float32
        self.k = [np.zeros((n_seq, n_ctx, args.n_head_kv, args.head_dim), dt) for _ in range(args.n_layer)]
        self.v = [np.zeros((n_seq, n_ctx, args.n_head_kv, args.head_dim_v), dt) for _ in range(args.n_layer)]
        self.pos = np.zeros(n_seq, np.int64)
        self.tables = np.arange(n_seq, dtype=np.int32).reshape(n_seq, 1)  # slot s = block s of n_ctx cells

    def layer_tables(self, il: int) -> np.ndarray:
        """Block tables int32[n_seq, max_blocks] of layer il's K/V pools (kernels_cpu.attention)."""
        return self.tables

    def prepare(self, runs: np.ndarray, lengths: np.ndarray) -> None:
        """Before a forward writing lengths[i] positions of sequence runs[i] (nothing to do)."""

    def commit(self, runs: np.ndarray, lengths: np.ndarray) -> None:
        """After that forward: the positions are filled."""
        self.pos[runs] += lengths

    @property
    def n_past(self) -> int:
        """Positions filled in slot 0 (the only slot of a single-sequence cache)."""
        return int(self.pos[0])

    @n_past.setter
    def n_past(self, n: int) -> None:
        self.pos[0] = n

    @property
    def nbytes(self) -> int:
        """Bytes reserved for K and V (all layers and slots)."""
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)
