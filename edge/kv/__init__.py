"""Paged KV cache: the block allocator with prefix caching (blocks.py)."""
from edge.kv.blocks import (HOLE, GroupStats, KVBlockManager, KVGroup, KVStats,
                            NoFreeBlocks)

__all__ = ["HOLE", "GroupStats", "KVBlockManager", "KVGroup", "KVStats", "NoFreeBlocks"]
