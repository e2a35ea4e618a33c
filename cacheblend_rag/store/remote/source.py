"""Chunks served from the remote tier layer by layer, the metadata field's decoding, and the local layer
LRU."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Protocol

from ..fileformat import FileMeta, InvalidKVFile, Parts
from ..tier import OnComplete, StoredChunkKV

META_FIELD = b"meta"


class LayerReader(Protocol):
    """Where a :class:`RemoteChunkKV` reads its layers (the :class:`~.tier.RedisKVTier` that made it)."""

    def read_parts(self, meta: FileMeta, layer: int) -> Parts: ...


def decode_meta(raw: bytes) -> dict[str, str]:
    """The metadata field's JSON as a map of strings; raises InvalidKVFile."""
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        raise InvalidKVFile(f"unreadable metadata ({exc})") from None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise InvalidKVFile("metadata is not a map of strings")
    return meta


class LayerCache:
    """LRU of fetched layers' encoded parts, (key, layer) -> parts, within a byte budget. Thread-safe."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.bytes = 0
        self._entries: OrderedDict[tuple[str, int], Parts] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, layer: int) -> Parts | None:
        with self._lock:
            kv = self._entries.get((key, layer))
            if kv is not None:
                self._entries.move_to_end((key, layer))
            return kv

    def put(self, key: str, layer: int, kv: Parts) -> None:
        size = _nbytes(kv)
        with self._lock:
            if size > self.budget or (key, layer) in self._entries:
                return
            while self.bytes + size > self.budget:
                _, dropped = self._entries.popitem(last=False)
                self.bytes -= _nbytes(dropped)
            self._entries[key, layer] = kv
            self.bytes += size

    def drop(self, key: str) -> None:
        with self._lock:
            for name in [name for name in self._entries if name[0] == key]:
                self.bytes -= _nbytes(self._entries.pop(name))


class RemoteChunkKV(StoredChunkKV):
    """A chunk served from the remote tier, one verified layer at a time (a ``ChunkKVSource``).

    With ``on_complete`` every layer read is kept, and once all have been read the whole chunk is handed
    to ``on_complete(key, EncodedChunk)`` (the KV store keeps it in RAM and writes it to local disk, as
    the encoded bytes it fetched). A layer
    that is gone or fails its crc raises ``CorruptKVError``, the server going down
    ``RemoteKVUnavailableError`` (a subclass); the engine then recomputes the chunk.
    """

    tier = "remote"

    def __init__(
        self, remote: LayerReader, meta: FileMeta, metadata: dict[str, str], on_complete: OnComplete | None
    ) -> None:
        super().__init__(meta.key, meta, metadata, on_complete)
        self._remote = remote
        self._meta = meta

    def _read(self, layer: int) -> Parts:
        return self._remote.read_parts(self._meta, layer)


def _nbytes(parts: Parts) -> int:
    return sum(t.nbytes for t in parts.values())
