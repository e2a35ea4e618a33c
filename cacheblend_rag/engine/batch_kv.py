"""The batch scheduler's memory: chunk KV shared by an admission group, and the decode batch's KV."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..blend.context import SharedContext
from ..blend.fusor import FusionResult
from ..blend.segments import ChunkKVSource, Segment
from ..models.runtime import KVCache, LayerwiseModel


class SharedChunk:
    """A chunk's KV read once for an admission group and served to every request of it that uses the
    chunk; its layers are dropped when the last of those requests has been fused."""

    def __init__(self, source: ChunkKVSource) -> None:
        self.source = source
        self.fingerprint = source.fingerprint
        self.num_tokens = source.num_tokens
        self.num_layers = source.num_layers
        self.users = 0
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()  # the pipelined loader reads ahead on its own thread

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            kv = self._layers.get(layer)
            if kv is None:
                kv = self._layers[layer] = self.source.layer(layer)
            return kv

    def release(self) -> None:
        with self._lock:
            self.users -= 1
            if self.users == 0:
                self._layers.clear()


def share_chunks(requests: Sequence[Sequence[Segment]]) -> list[list[Segment]]:
    """Each request's segments with every cached source replaced by one :class:`SharedChunk` per source.

    Sources are matched by identity: the store hands out one object per chunk (its RAM-tier entry, or the
    one live disk reader), so requests built from the same store share them, while KV a caller attached
    by hand is never mixed with another copy that might differ in dtype.
    """
    shared: dict[int, SharedChunk] = {}
    out = []
    for request in requests:
        segments = []
        for segment in request:
            if segment.kv is None:
                segments.append(segment)
                continue
            chunk = shared.get(id(segment.kv))
            if chunk is None:
                chunk = shared[id(segment.kv)] = SharedChunk(segment.kv)
            chunk.users += 1
            segments.append(replace(segment, kv=chunk))
        out.append(segments)
    return out


def fusion_batches(items: Sequence[int], sizes: Sequence[int], budget: int) -> list[list[int]]:
    """``items`` split, in order, into runs whose ``sizes`` (bytes of each request's fusion cache) sum to
    at most ``budget`` (a single item larger than the budget runs alone): what may be fused together."""
    batches: list[list[int]] = []
    used = 0
    for item, size in zip(items, sizes, strict=True):
        if batches and used + size <= budget:
            batches[-1].append(item)
            used += size
        else:
            batches.append([item])
            used = size
    return batches


@dataclass(frozen=True)
class RowContext:
    """A decode row that reads its prompt from a round's cache in place (:mod:`~..blend.context`): its view
    of the round, and the position of the first token it feeds, which takes slot 0 of its own row."""

    shared: SharedContext
    start: int


class DecodeCache:
    """The decode batch's KV: per layer [rows, Hkv, capacity, d]; active rows occupy slots 0..n-1.

    A row holds its whole prompt's KV (slot == position), except a round's member: its prompt stays in the
    round's cache, held once for all the round's members (:class:`RowContext`), and its row holds only the
    tokens it generates."""

    def __init__(self, model: LayerwiseModel) -> None:
        self.model = model
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.contexts: dict[int, RowContext] = {}  # by row

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def nbytes(self) -> int:
        """The buffer's bytes and, once each, those of the round caches its rows read."""
        rounds = {id(c.shared.kv): c.shared.kv.nbytes for c in self.contexts.values()}
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values)) + sum(rounds.values())

    @staticmethod
    def slots_needed(fusion: FusionResult, max_tokens: int) -> int:
        """Slots a fused prompt's row takes: its prompt and the tokens it may feed back, or only those when
        it reads its prompt from a round's cache."""
        return max_tokens if fusion.context is not None else fusion.num_tokens + max_tokens

    def reserve(self, rows: int, capacity: int, keep: int) -> None:
        """Make room for ``rows`` rows of ``capacity`` slots, keeping the first ``keep`` rows' contents.
        A new buffer is sized exactly to the request, so it never exceeds what admission allowed."""
        if rows <= self.rows and capacity <= self.capacity:
            return
        fresh = self.model.new_cache(capacity, batch=rows)
        if keep:
            span = min(capacity, self.capacity)
            for old, new in zip((*self.keys, *self.values), (*fresh.keys, *fresh.values), strict=True):
                new[:keep, :, :span] = old[:keep, :, :span]
        self.keys, self.values = fresh.keys, fresh.values

    def place(self, slot: int, fusion: FusionResult) -> None:
        """Give a fused prompt row ``slot``: a round's member reads its prompt from the round's cache;
        any other prompt's KV (its first ``fusion.num_tokens`` slots) is copied into the row. Slots past
        them keep stale data, which is harmless: a row's query sees only the slots up to its own, and that
        slot is written by the same forward before attention reads it."""
        if fusion.context is not None:
            self.contexts[slot] = RowContext(fusion.context, fusion.num_tokens)
            return
        self.contexts.pop(slot, None)
        fusion.write_into(self.keys, self.values, slot)

    def move(self, source: int, target: int) -> None:
        for buf in (*self.keys, *self.values):
            buf[target] = buf[source]
        moved = self.contexts.pop(source, None)
        if moved is None:
            self.contexts.pop(target, None)
        else:
            self.contexts[target] = moved

    def drop(self, slot: int) -> None:
        """Row ``slot`` is free: the round cache it read (if no other row reads it) can go."""
        self.contexts.pop(slot, None)

    def view(self, rows: int) -> KVCache:
        """The first ``rows`` rows as a cache whose writes land in this buffer."""
        return KVCache([k[:rows] for k in self.keys], [v[:rows] for v in self.values])

    def row_contexts(self, rows: int) -> list[RowContext | None]:
        """Per row of the first ``rows``, the round cache it reads its prompt from (None: its own row)."""
        return [self.contexts.get(slot) for slot in range(rows)]

    def release(self) -> None:
        self.keys, self.values = [], []
        self.contexts.clear()
