"""The RAM tier: an LRU of whole chunks' KV, kept encoded in the store's codec, within a byte budget of
encoded bytes (a chunk is decoded one layer at a time as it is read)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from .fileformat import EncodedChunk


class RamTier:
    """LRU of :class:`EncodedChunk` within ``budget`` encoded bytes (a :class:`~.tier.KVTier`).
    Thread-safe."""

    name = "ram"

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.bytes = 0
        self._entries: OrderedDict[str, EncodedChunk] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, key: str) -> bool:
        return key in self._entries

    def fits(self, nbytes: int) -> bool:
        """Whether a chunk of ``nbytes`` could be kept at all."""
        return nbytes <= self.budget

    def get(self, key: str) -> EncodedChunk | None:
        with self._lock:
            kv = self._entries.get(key)
            if kv is not None:
                self._entries.move_to_end(key)
            return kv

    def put(self, key: str, kv: EncodedChunk) -> int:
        """Insert (or refresh) ``kv``; returns how many entries were evicted to make room."""
        size = kv.nbytes
        evicted = 0
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes
            if size > self.budget:
                return 0
            while self.bytes + size > self.budget:
                _, dropped = self._entries.popitem(last=False)
                self.bytes -= dropped.nbytes
                evicted += 1
            self._entries[key] = kv
            self.bytes += size
        return evicted

    def delete(self, key: str) -> bool:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes
            return old is not None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0
