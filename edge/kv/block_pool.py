"""One layer group's block pool for edge.kv.blocks (vLLM v1's block_pool.py): the blocks'
reference counts and hashes, the LRU free queue and the prefix hash map. The rules that use
them are in edge.kv.blocks' module docstring."""
from __future__ import annotations

from collections import OrderedDict


class Block:
    """A block's reference count (tables holding it) and registered hash (None: unregistered)."""

    __slots__ = ("ref_count", "block_hash")

    def __init__(self):
        self.ref_count = 0
        self.block_hash: bytes | None = None


class BlockPool:
    """One layer group's blocks, LRU free queue (block id -> None, head first) and hash map.

    Args:
        n_blocks: blocks in the pool. window: the group's attention window (0 = full).
    """

    def __init__(self, n_blocks: int, window: int = 0):
        self.window = window
        self.blocks = [Block() for _ in range(n_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(n_blocks))
        self.cached: dict[bytes, int] = {}

    def first_visible_block(self, p: int, block_size: int, lookahead: int = 0) -> int:
        """Index of the first block a query at position ``p - lookahead`` (or later) can see."""
        if self.window == 0:
            return 0
        return max(0, p - lookahead - self.window + 1) // block_size

    def take_cached(self, block_id: int) -> None:
        """A prefix hit on a block: out of the free queue when free, one more reference."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def take_fresh(self) -> int:
        """The free queue's head for new data (its hash, if any, is evicted), count 1."""
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def release(self, block_id: int) -> None:
        """One reference less; at 0 the block goes to the free queue's tail (still cached)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None

    def forget(self, block_id: int) -> None:
        """A free block whose contents are dropped: no hash, first in the free queue."""
        self.unregister(block_id)
        self.free_queue.move_to_end(block_id, last=False)

    def unregister(self, block_id: int) -> None:
        """Drop a held block's hash (its slots are about to be written again)."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Register a full, computed block under its hash, unless that hash has a block."""
        if block_hash not in self.cached:
            self.cached[block_hash] = block_id
            self.blocks[block_id].block_hash = block_hash
