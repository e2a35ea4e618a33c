"""What a KV store tier is: a keyed place for whole chunks' per-layer K/V.

:class:`~cacheblend_rag.store.kvstore.KVStore` stacks tiers (RAM over disk): a read tries each in turn,
a write goes to each. A tier keeps chunks in the storage dtype; what it returns serves one layer at a time
(:class:`~cacheblend_rag.blend.segments.ChunkKVSource`) and names its tier (``tier``) so the loading
controller knows how fast it loads.
"""

from __future__ import annotations

from typing import Protocol

from ..blend.segments import ChunkKV, ChunkKVSource


class KVTier(Protocol):
    """A store tier: get/put/contains/delete of one chunk's per-layer K/V by key."""

    name: str

    def get(self, key: str) -> ChunkKVSource | None:
        """The chunk's KV, or None when this tier does not hold it."""
        ...

    def put(self, key: str, kv: ChunkKV) -> int:
        """Keep ``kv`` (already in the storage dtype) under ``key``."""
        ...

    def contains(self, key: str) -> bool: ...

    def delete(self, key: str) -> bool:
        """Drop ``key``; whether the tier held it."""
        ...


def tier_of(source: ChunkKVSource) -> str:
    """The tier a source was served from ('ram' for KV held in memory)."""
    return getattr(source, "tier", "ram")
