"""What a KV store tier is: a keyed place for whole chunks' per-layer K/V.

:class:`~cacheblend_rag.store.kvstore.KVStore` stacks tiers (RAM over disk over an optional shared
remote tier): a read tries each in turn, a write goes to each. A tier keeps chunks encoded in the
store's codec (:mod:`.codec`; for a float codec, the tensors in that dtype); what it returns serves one
decoded layer at a time (:class:`~cacheblend_rag.blend.segments.ChunkKVSource`) and
names its tier (``tier``) so the loading controller knows how fast it loads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import torch

from ..blend.segments import ChunkKVSource
from .fileformat import EncodedChunk, FileMeta, Parts

LayerKV = tuple[torch.Tensor, torch.Tensor]
OnComplete = Callable[[str, EncodedChunk], None]


class KVTier(Protocol):
    """A store tier: get/put/contains/delete of one chunk's per-layer K/V by key."""

    name: str

    def get(self, key: str) -> ChunkKVSource | None:
        """The chunk's KV, or None when this tier does not hold it."""
        ...

    def put(self, key: str, kv: EncodedChunk) -> int:
        """Keep ``kv`` (encoded in the store's codec) under ``key``."""
        ...

    def contains(self, key: str) -> bool: ...

    def delete(self, key: str) -> bool:
        """Drop ``key``; whether the tier held it."""
        ...


class StoredChunkKV:
    """A chunk a slower tier (disk, remote) serves one verified layer at a time (a ``ChunkKVSource``),
    decoding each layer as it is asked for (by the load pipeline's prefetch thread, so decoding overlaps
    recompute).

    With ``on_complete``, each layer's encoded parts are kept (as memory of their own, :meth:`_own`) and
    once every layer has been read the whole chunk is handed to ``on_complete(key, EncodedChunk)`` (the
    store keeps it, still encoded, in a faster tier); a layer asked for again is then decoded from that
    copy. Subclasses read a layer's parts in :meth:`_read`, raising ``CorruptKVError`` for one that fails
    its checks.
    """

    tier = "stored"

    def __init__(
        self, key: str, meta: FileMeta, metadata: dict[str, str], on_complete: OnComplete | None
    ) -> None:
        self.key = key
        self.fingerprint = meta.model_fingerprint
        self.num_tokens = meta.num_tokens
        self.num_layers = meta.num_layers
        self.codec = meta.codec
        self._metadata = metadata
        self._on_complete = on_complete
        self._kept: dict[int, Parts] = {}
        self._lock = threading.Lock()

    def layer(self, layer: int) -> LayerKV:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for a chunk with {self.num_layers} layers")
        with self._lock:
            parts = self._kept.get(layer)
            if parts is None:
                parts = self._read(layer)
                if self._on_complete is not None:
                    parts = self._kept[layer] = self._own(parts)
                    if len(self._kept) == self.num_layers:
                        callback, self._on_complete = self._on_complete, None
                        layers = [self._kept[i] for i in range(self.num_layers)]
                        encoded = EncodedChunk(
                            self.codec, layers, self.fingerprint, self.num_tokens, dict(self._metadata)
                        )
                        callback(self.key, encoded)
        return self.codec.decode(parts)

    def encoded(self) -> EncodedChunk:
        """The whole chunk, every layer read and checked, still encoded (raises ``CorruptKVError``)."""
        with self._lock:
            layers = [self._kept.get(i) or self._own(self._read(i)) for i in range(self.num_layers)]
        return EncodedChunk(self.codec, layers, self.fingerprint, self.num_tokens, dict(self._metadata))

    def _read(self, layer: int) -> Parts:
        raise NotImplementedError

    def _own(self, parts: Parts) -> Parts:
        """``parts`` as tensors that stay valid once the source is gone (a tier that reads into memory
        of its own returns them as they are)."""
        return parts


def tier_of(source: ChunkKVSource) -> str:
    """The tier a source was served from ('ram' for KV held in memory)."""
    return getattr(source, "tier", "ram")
