"""What the fusor consumes: a prompt as a sequence of segments, some backed by precomputed chunk KV."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from ..models.runtime import LayerwiseModel


@runtime_checkable
class ChunkKVSource(Protocol):
    """Precomputed KV of one chunk, readable one layer at a time.

    Keys are rotated to the chunk's own positions 0..n-1 (the chunk was prefilled alone, without BOS);
    the fusor re-rotates them to where the chunk lands in the prompt. Shapes are [Hkv, n, head_dim].
    """

    fingerprint: str
    num_tokens: int
    num_layers: int

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class ChunkKV:
    """A chunk's KV held in memory (what a chunk prefill produces and what the RAM tier keeps)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    fingerprint: str

    @property
    def num_tokens(self) -> int:
        return self.keys[0].shape[1]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer], self.values[layer]

    def to(self, dtype: torch.dtype) -> ChunkKV:
        return ChunkKV([k.to(dtype) for k in self.keys], [v.to(dtype) for v in self.values], self.fingerprint)


@dataclass(frozen=True)
class Segment:
    """A run of prompt tokens. With ``kv`` it is a cached chunk whose KV may be reused; without, fresh
    text (chat template, separators, the question) that is computed at every layer."""

    token_ids: tuple[int, ...]
    kv: ChunkKVSource | None = field(default=None, compare=False)
    chunk_id: str | None = None

    @classmethod
    def fresh(cls, token_ids: Sequence[int]) -> Segment:
        return cls(tuple(token_ids))

    @classmethod
    def cached(cls, token_ids: Sequence[int], kv: ChunkKVSource, chunk_id: str | None = None) -> Segment:
        return cls(tuple(token_ids), kv, chunk_id)

    @property
    def is_cached(self) -> bool:
        return self.kv is not None

    def __len__(self) -> int:
        return len(self.token_ids)


def prefill_chunk_kv(model: LayerwiseModel, token_ids: Sequence[int]) -> ChunkKV:
    """A chunk's KV as it is stored and reused: the chunk prefilled alone at positions 0..n-1, no BOS."""
    n = len(token_ids)
    _, cache = model.prefill(list(token_ids))
    return ChunkKV(
        [k[0, :, :n].clone() for k in cache.keys],
        [v[0, :, :n].clone() for v in cache.values],
        model.fingerprint,
    )


class LayerKVProvider(Protocol):
    """Serves, layer by layer, the K/V of every cached segment of one request (in segment order).

    The store's pipelined loader implements it so layer i+1 is read while the fusor computes layer i.
    """

    def layer(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    def close(self) -> None: ...


class DirectLayerKV:
    """Reads each cached segment's layer when asked, with no prefetch."""

    def __init__(self, sources: Sequence[ChunkKVSource]) -> None:
        self.sources = list(sources)

    def layer(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [source.layer(layer) for source in self.sources]

    def close(self) -> None:
        pass
