"""The host's plan of a static fusion: every size fixed, padded to a bucket, before the first device op.

A fusion whose sizes the device decides (a selection built with ``nonzero`` or a boolean mask, a chunk
count read back with ``bincount``, row blocks cut at ``item()`` bounds) makes the host wait for the device
several times per layer, and gives a graph compiler a new shape at every prompt. Here the host knows every
size from the prompt's layout alone: the prompt length, its fresh rows, its cached rows, its chunks and
the number of rows a method recomputes (fresh rows plus its budget). Each is padded up to a bucket
(:func:`bucket`), so prompts of nearby sizes share one shape; padded rows sit at a dummy slot after the
prompt (:attr:`StaticLayout.dummy`), which no real row's causal mask reaches, and sum into no chunk.

What a method selects is one of three kinds (:class:`StaticSelection`): positions the host knows
(full reuse, EPIC, prefix caching, full recompute), the top of the question's attention from a probe
(CacheBlend's default; its budget known on the host) or HKVD's narrowing at check layers (each check's
budget known on the host). A method returns None from ``static_selection`` when it needs what only the
device knows (an attention-cover budget, a margin read from the probe's logits): the fusor then takes the
module-by-module path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

import torch

from ..models.fused import signed_sin
from ..models.rope import Rope
from .plan import FusionPlan
from .probe import query_positions


def bucket(n: int, smallest: int = 16) -> int:
    """``n`` rounded up to one of eight sizes per power of two (at most 12.5% padding), at least
    ``smallest``: nearby prompt sizes share a shape, and so a traced step."""
    n = max(n, smallest)
    step = max(1, 2 ** (math.floor(math.log2(n)) - 3))
    return -(-n // step) * step


@dataclass(frozen=True)
class HostRows:
    """The same positions at every layer, known on the host (ascending, every must-compute one)."""

    positions: torch.Tensor


@dataclass(frozen=True)
class QueryTopK:
    """A probe of the first ``probe_layers`` layers scores the cached tokens by the question's attention
    (``score``: the attention, or that times each value's norm); the ``budget`` best are recomputed."""

    budget: int
    score: Literal["attention", "contribution"]
    probe_layers: int


@dataclass(frozen=True)
class DeviationNarrowing:
    """HKVD: ``positions`` at layer 0; at each of ``checks`` (layer, budget), the cached rows whose fresh
    K (``signal`` "k") or V ("v") deviates most from the cached one keep going, ``budget`` of them."""

    positions: torch.Tensor
    checks: tuple[tuple[int, int], ...]
    signal: Literal["k", "v"]


StaticSelection = HostRows | QueryTopK | DeviationNarrowing


@dataclass(frozen=True)
class StaticLayout:
    """One prompt's sizes and index tables, padded to buckets; tensors on the fusion's device."""

    num_tokens: int  # T
    keys: int  # Tb: slots attention reads (T padded, at least T + 1)
    fresh: int  # real must-compute rows
    fresh_rows: torch.Tensor  # [Mb] their positions, then the dummy slot
    token_ids: torch.Tensor  # [Tb] the prompt's ids, 0 after it
    cached: int  # real cached rows (every cached span, exact ones too)
    cached_index: torch.Tensor  # [Ncb] their positions, then the dummy slot
    cached_start: int  # the first of them where they lie back to back, else -1
    rerotation: tuple[torch.Tensor, torch.Tensor]  # [Ncb, d] float32 cos, signed sin (identity padding)
    candidate_bias: torch.Tensor  # [Tb] float32: 0 where a position may be chosen, -inf elsewhere
    chunks: int  # C1b: chunk slots (the last real one + 1 is "no chunk", always zero)
    measure_slot: torch.Tensor  # [Tb] the chunk a recomputed position measures (else C1b: none)
    no_chunk: int  # C: the real chunks
    span: int  # N: the longest chunk, padded
    chunk_index: torch.Tensor  # [C1b N] each chunk slot's positions, then the dummy slot
    scored: int  # R: the probe's last fresh rows that hold every query row (padding included)
    first_query: int  # the first query row's position (the question's start)
    shift_tables: tuple[torch.Tensor, torch.Tensor]  # [Tb, d] float32 unscaled cos, signed sin
    rope_tables: tuple[torch.Tensor, torch.Tensor]  # [Tb, d] in the model's dtype, scaled as RoPE is

    @classmethod
    def tensor_fields(cls) -> tuple[str, ...]:
        """The fields holding tensors (alone or in a tuple): what differs between prompts of one bucket."""
        return tuple(f.name for f in fields(cls) if f.type not in ("int",))

    @property
    def dummy(self) -> int:
        """The slot padded rows read and write: after the prompt, before the end of the keys."""
        return self.keys - 1

    @property
    def fresh_bucket(self) -> int:
        return self.fresh_rows.numel()

    @classmethod
    def build(cls, plan: FusionPlan, rope: Rope, dtype: torch.dtype, device: torch.device) -> StaticLayout:
        # Host lists, packed into one transfer per dtype: every table is a view of those, so the host
        # queues a handful of operations whatever the prompt.
        n = plan.num_tokens
        keys = bucket(n + 1)
        dummy = keys - 1
        must, cached_flags = plan.must_compute.tolist(), plan.cached_mask.tolist()
        candidate = plan.candidate_mask.tolist() + [False] * (keys - n)
        fresh = [i for i, flag in enumerate(must) if flag]
        cached = [i for i, flag in enumerate(cached_flags) if flag]
        spans = plan.chunk_spans()
        no_chunk = len(spans)
        chunks = bucket(max(no_chunk, 1), smallest=4)
        slots = [chunks] * keys  # chunk slot C1b: no chunk (measures nothing)
        for index, (start, end) in enumerate(spans):
            slots[start:end] = [index] * (end - start)
        measure = [slot if ok else chunks for slot, ok in zip(slots, candidate, strict=True)]
        span = bucket(max((end - start for start, end in spans), default=1))
        chunk_index = [dummy] * (chunks * span)
        for index, (start, end) in enumerate(spans):
            chunk_index[index * span : index * span + end - start] = range(start, end)
        fresh_bucket, cached_bucket = bucket(len(fresh)), bucket(len(cached))
        first_query = int(query_positions(plan)[0]) if n else 0
        tail = fresh_bucket - sum(1 for p in fresh if p < first_query)
        longs = [
            fresh + [dummy] * (fresh_bucket - len(fresh)),
            plan.token_ids.tolist() + [0] * (keys - n),
            cached + [dummy] * (cached_bucket - len(cached)),
            measure,
            chunk_index,
        ]
        packed = torch.tensor([x for part in longs for x in part]).to(device, non_blocking=True)
        fresh_rows, token_ids, cached_index, measure_slot, chunk_index_t = packed.split(
            [len(x) for x in longs]
        )

        local = [i for start, end in plan.cached_spans() for i in range(end - start)]
        padding = [0] * (cached_bucket - len(local))  # from 0 to 0: no rotation (cos 1, sin 0)
        cos, sin = rope.rerotation(
            torch.tensor(local + padding), torch.tensor(cached + padding), torch.float32
        )
        shift_cos, shift_sin = rope.cos_sin(torch.arange(keys), torch.float32, scaled=False)
        bias = torch.tensor([0.0 if ok else float("-inf") for ok in candidate])
        floats = [cos, signed_sin(sin), shift_cos, signed_sin(shift_sin)]
        joined = torch.cat([*(t.view(-1) for t in floats), bias]).to(device, non_blocking=True)
        parts = joined.split([t.numel() for t in floats] + [keys])
        rerotation = (parts[0].view(cos.shape), parts[1].view(cos.shape))
        shift_tables = (parts[2].view(shift_cos.shape), parts[3].view(shift_cos.shape))
        # RoPE's own tables: the same angles times the rope type's amplitude, in the model's dtype
        scaled = torch.stack(shift_tables) * rope.attention_scaling if rope.attention_scaling != 1.0 else None
        rope_tables = (scaled if scaled is not None else torch.stack(shift_tables)).to(dtype)

        return cls(
            num_tokens=n,
            keys=keys,
            fresh=len(fresh),
            fresh_rows=fresh_rows,
            token_ids=token_ids,
            cached=len(cached),
            cached_index=cached_index,
            cached_start=cached[0] if cached and cached[-1] - cached[0] + 1 == len(cached) else -1,
            rerotation=rerotation,
            candidate_bias=parts[4],
            chunks=chunks,
            measure_slot=measure_slot,
            no_chunk=no_chunk,
            span=span,
            chunk_index=chunk_index_t,
            scored=min(fresh_bucket, bucket(tail, smallest=1)),
            first_query=first_query,
            shift_tables=shift_tables,
            rope_tables=(rope_tables[0], rope_tables[1]),
        )

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Host-known ascending positions padded to their bucket with the dummy slot, on the device."""
        return _padded(positions, bucket(positions.numel()), self.dummy).to(self.fresh_rows.device)


def _padded(positions: torch.Tensor, size: int, fill: int) -> torch.Tensor:
    out = torch.full((size,), fill, dtype=torch.long)
    out[: positions.numel()] = positions
    return out
