"""What the fusor consumes: a prompt as a sequence of segments, some backed by precomputed chunk KV."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from ..models.runtime import KVCache, LayerwiseModel


@dataclass(frozen=True)
class ChunkContext:
    """The tokens a chunk is prefilled behind when its KV is precomputed.

    A chunk prefilled alone from position 0 turns its first token into an attention sink at every layer;
    inside a prompt it never is one, and recomputing some of its tokens next to such fake sinks can make
    answers worse, not better (docs/fusor.md). Prefilled behind a short context of its own — the chat
    template's opening with a neutral system message, the same for every chunk — its tokens see a real
    sink and a plausible lead-in, as they will in a prompt. The context's KV is then dropped and the
    chunk's keys are rotated back to 0..n-1, so the stored layout is the same either way. The context is
    part of the chunk's KV key: KV computed behind another context never hits.
    """

    token_ids: tuple[int, ...] = ()

    @property
    def key(self) -> str:
        """Identifies the context inside a chunk KV key ('' for none: the chunk prefilled alone)."""
        if not self.token_ids:
            return ""
        return hashlib.sha256(np.asarray(self.token_ids, dtype="<i8").tobytes()).hexdigest()[:32]

    def __len__(self) -> int:
        return len(self.token_ids)


NO_CONTEXT = ChunkContext()


@runtime_checkable
class ChunkKVSource(Protocol):
    """Precomputed KV of one chunk, readable one layer at a time.

    Keys are rotated to the chunk's own positions 0..n-1 (whatever :class:`ChunkContext` it was
    prefilled behind); the fusor re-rotates them to where the chunk lands in the prompt. Shapes are
    [Hkv, n, head_dim].
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
    text (chat template, separators, the question) that is computed at every layer.

    ``exact``: the KV is this prompt's own KV at these positions (the prompt's head, prefilled from
    position 0, as a prefix cache holds it), so no method needs to recompute any of it.

    ``computed``: no cache tier held the KV; it was computed for this request (and stored for the next),
    so results count it apart from KV read from a tier (docs/accounting.md)."""

    token_ids: tuple[int, ...]
    kv: ChunkKVSource | None = field(default=None, compare=False)
    chunk_id: str | None = None
    exact: bool = False
    computed: bool = field(default=False, compare=False)

    @classmethod
    def fresh(cls, token_ids: Sequence[int]) -> Segment:
        return cls(tuple(token_ids))

    @classmethod
    def cached(
        cls,
        token_ids: Sequence[int],
        kv: ChunkKVSource,
        chunk_id: str | None = None,
        exact: bool = False,
        computed: bool = False,
    ) -> Segment:
        return cls(tuple(token_ids), kv, chunk_id, exact, computed)

    @property
    def is_cached(self) -> bool:
        return self.kv is not None

    def __len__(self) -> int:
        return len(self.token_ids)


def kv_sources(segments: Sequence[Segment]) -> list[ChunkKVSource]:
    """The cached segments' KV sources, in prompt order (what a layer KV provider serves)."""
    return [s.kv for s in segments if s.kv is not None]


def prefill_chunk_kv(
    model: LayerwiseModel,
    token_ids: Sequence[int],
    context: ChunkContext = NO_CONTEXT,
    context_cache: KVCache | None = None,
) -> ChunkKV:
    """A chunk's KV as it is stored and reused: the chunk prefilled behind ``context`` (alone at positions
    0..n-1 when there is none), the context's own KV dropped and the keys rotated back to 0..n-1.

    ``context_cache`` (from :func:`prefill_context`) saves prefilling the same context for every chunk."""
    n, p = len(token_ids), len(context)
    if p == 0:
        _, cache = model.prefill(list(token_ids))
        keys = [k[0, :, :n].clone() for k in cache.keys]
    else:
        cache = model.new_cache(p + n)
        shared = context_cache if context_cache is not None else prefill_context(model, context)
        for layer in range(model.num_layers):
            cache.keys[layer][:, :, :p] = shared.keys[layer][:, :, :p]
            cache.values[layer][:, :, :p] = shared.values[layer][:, :, :p]
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=model.device)[None]
        model.forward(ids, torch.arange(p, p + n, device=model.device), cache)
        here = torch.arange(p, p + n, device=model.device)
        # rotated back in float64 (Rope.rerotate): the stored keys are those of positions 0..n-1
        keys = [model.rope.rerotate(k[0, :, p:].float(), here, here - p).to(k.dtype) for k in cache.keys]
    return ChunkKV(keys, [v[0, :, p : p + n].clone() for v in cache.values], model.fingerprint)


def prefill_context(model: LayerwiseModel, context: ChunkContext) -> KVCache:
    """The KV of ``context`` alone, shared by every chunk prefilled behind it."""
    _, cache = model.prefill(list(context.token_ids))
    return cache


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
