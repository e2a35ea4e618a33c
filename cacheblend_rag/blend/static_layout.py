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
    rerotation: tuple[torch.Tensor, torch.Tensor]  # [Ncb, d] float32 cos, signed sin (identity padding)
    candidate_bias: torch.Tensor  # [Tb] float32: 0 where a position may be chosen, -inf elsewhere
    chunks: int  # C1b: chunk slots (the last real one + 1 is "no chunk", always zero)
    move_slot: torch.Tensor  # [Tb] the chunk a position is moved with (no chunk: slot C)
    measure_slot: torch.Tensor  # [Tb] the chunk a recomputed position measures (non-candidates: slot C)
    no_chunk: int  # C: the zero slot
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
        n = plan.num_tokens
        keys = bucket(n + 1)
        dummy = keys - 1
        fresh = plan.must_compute.nonzero().squeeze(1)
        cached = plan.cached_mask.nonzero().squeeze(1)
        # per-span tables from Python lists, one tensor each: a few operations whatever the chunk count
        spans = plan.chunk_spans()
        no_chunk = len(spans)
        slots = [no_chunk] * keys
        for index, (start, end) in enumerate(spans):
            slots[start:end] = [index] * (end - start)
        move_slot = torch.tensor(slots)
        measure_slot = torch.where(_padded_mask(plan.candidate_mask, keys), move_slot, no_chunk)
        bias = torch.zeros(keys).masked_fill_(~_padded_mask(plan.candidate_mask, keys), float("-inf"))
        ids = torch.cat((plan.token_ids, torch.zeros(keys - n, dtype=torch.long)))

        cached_bucket = bucket(cached.numel())
        local = [i for start, end in plan.cached_spans() for i in range(end - start)]
        padding = [0] * (cached_bucket - len(local))  # from 0 to 0: no rotation (cos 1, sin 0)
        cos, sin = rope.rerotation(
            torch.tensor(local + padding), torch.tensor(cached.tolist() + padding), torch.float32
        )
        all_positions = torch.arange(keys)
        shift_cos, shift_sin = rope.cos_sin(all_positions, torch.float32, scaled=False)
        rope_cos, rope_sin = rope.cos_sin(all_positions, dtype)

        def put(x: torch.Tensor) -> torch.Tensor:
            return x.to(device, non_blocking=True)

        return cls(
            num_tokens=n,
            keys=keys,
            fresh=fresh.numel(),
            fresh_rows=put(_padded(fresh, bucket(fresh.numel()), dummy)),
            token_ids=put(ids),
            cached=cached.numel(),
            cached_index=put(_padded(cached, cached_bucket, dummy)),
            rerotation=(put(cos), put(signed_sin(sin))),
            candidate_bias=put(bias),
            chunks=bucket(no_chunk + 1, smallest=4),
            move_slot=put(move_slot),
            measure_slot=put(measure_slot),
            no_chunk=no_chunk,
            shift_tables=(put(shift_cos), put(signed_sin(shift_sin))),
            rope_tables=(put(rope_cos), put(signed_sin(rope_sin))),
        )

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Host-known ascending positions padded to their bucket with the dummy slot, on the device."""
        return _padded(positions, bucket(positions.numel()), self.dummy).to(self.fresh_rows.device)


def _padded(positions: torch.Tensor, size: int, fill: int) -> torch.Tensor:
    out = torch.full((size,), fill, dtype=torch.long)
    out[: positions.numel()] = positions
    return out


def _padded_mask(mask: torch.Tensor, size: int) -> torch.Tensor:
    return torch.cat((mask, torch.zeros(size - mask.numel(), dtype=torch.bool)))
