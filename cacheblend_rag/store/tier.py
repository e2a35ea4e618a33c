"""What a KV store tier is: a keyed place for whole chunks' per-layer K/V.

:class:`~cacheblend_rag.store.kvstore.KVStore` stacks tiers (RAM over disk over an optional shared
remote tier): a read tries each in turn, a write goes to each. A tier keeps chunks in the storage dtype;
what it returns serves one layer at a time (:class:`~cacheblend_rag.blend.segments.ChunkKVSource`) and
names its tier (``tier``) so the loading controller knows how fast it loads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import torch

from ..blend.segments import ChunkKV, ChunkKVSource

LayerKV = tuple[torch.Tensor, torch.Tensor]
OnComplete = Callable[[str, ChunkKV], None]


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


class StoredChunkKV:
    """A chunk a slower tier (disk, remote) serves one verified layer at a time (a ``ChunkKVSource``).

    With ``on_complete``, each layer read is kept (as memory of its own, :meth:`_own`) and once every
    layer has been read the whole chunk is handed to ``on_complete(key, ChunkKV)`` (the store keeps it in
    a faster tier); a layer asked for again is then served from that copy. Subclasses read a layer in
    :meth:`_read`, raising ``CorruptKVError`` for one that fails its checks.
    """

    tier = "stored"

    def __init__(
        self, key: str, fingerprint: str, num_tokens: int, num_layers: int, on_complete: OnComplete | None
    ) -> None:
        self.key = key
        self.fingerprint = fingerprint
        self.num_tokens = num_tokens
        self.num_layers = num_layers
        self._on_complete = on_complete
        self._kept: dict[int, LayerKV] = {}
        self._lock = threading.Lock()

    def layer(self, layer: int) -> LayerKV:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for a chunk with {self.num_layers} layers")
        with self._lock:
            kept = self._kept.get(layer)
            if kept is not None:
                return kept
            kv = self._read(layer)
            if self._on_complete is None:
                return kv
            kv = self._kept[layer] = self._own(kv)
            if len(self._kept) == self.num_layers:
                callback, self._on_complete = self._on_complete, None
                layers = [self._kept[i] for i in range(self.num_layers)]
                callback(self.key, ChunkKV([k for k, _ in layers], [v for _, v in layers], self.fingerprint))
            return kv

    def _read(self, layer: int) -> LayerKV:
        raise NotImplementedError

    def _own(self, kv: LayerKV) -> LayerKV:
        """``kv`` as tensors that stay valid once the source is gone (a tier that reads into memory of
        its own returns them as they are)."""
        return kv


def tier_of(source: ChunkKVSource) -> str:
    """The tier a source was served from ('ram' for KV held in memory)."""
    return getattr(source, "tier", "ram")
