"""Placing cached chunk KV into a fusion's cache: each chunk's layer at its prompt positions, keys re-rotated.

A chunk's keys are stored rotated to its own positions 0..n-1; in a prompt it lands at start..start+n-1, so
its keys turn by the angle difference (float64 angles, float32 tables: :meth:`Rope.rerotation`). The tables
depend on the positions only, so they are built once per fusion for every cached span (a span at 0 by the
identity) and used at every layer.

On an accelerator a layer's chunks are placed together: one concatenation, one rotation, one write (a
slice when the spans lie back to back, an indexed write when fresh text separates them), a fixed number of
operations per layer whatever the number of chunks: there the host's dispatch of a dozen operations per
chunk per layer cost more than the copies (BENCHMARKS.md, section ``gpu``). On the CPU, where dispatch is
cheap and every pass over the bytes counts, each chunk is rotated straight into its cache slice (the joined
path's extra copies took 73 ms per 6 x 512 fusion there against 32 ms).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..models.rope import Rope
from ..models.runtime import KVCache


@dataclass(frozen=True)
class CachedPlacement:
    """Where a prompt's cached ``spans`` go ([start, end), ascending): ``index`` (every cached position,
    ascending; None when the spans lie back to back) and the float32 cos/sin ``tables`` that re-rotate their
    keys, all spans' rows in order."""

    spans: tuple[tuple[int, int], ...]
    index: torch.Tensor | None
    tables: tuple[torch.Tensor, torch.Tensor] | None
    device: torch.device
    batched: bool = True  # all chunks of a layer at once (accelerators), else chunk by chunk (the CPU)

    @classmethod
    def for_spans(
        cls, rope: Rope, spans: list[tuple[int, int]], device: torch.device, batched: bool | None = None
    ) -> CachedPlacement:
        """The placement of cached ``spans`` ([start, end), ascending) on ``device``; ``batched`` defaults
        to whether the device is an accelerator."""
        tables = []
        for start, end in spans:
            local = torch.arange(end - start, device=device)
            # float32 tables of a float64 angle difference: within ~1e-6 of float64 rotation, half the
            # memory traffic at every layer
            tables.append(rope.rerotation(local, local + start, torch.float32))
        index = None
        if not all(a[1] == b[0] for a, b in itertools.pairwise(spans)):
            index = torch.cat([torch.arange(start, end) for start, end in spans]).to(device)
        joined = None
        if tables:
            joined = (torch.cat([cos for cos, _ in tables]), torch.cat([sin for _, sin in tables]))
        batched = device.type != "cpu" if batched is None else batched
        return cls(tuple(spans), index, joined, device, batched)

    def place(self, cache: KVCache, layer: int, layer_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write every cached chunk's K/V of ``layer`` (``layer_kv``: per span, [Hkv, n, d] K and V rotated
        to 0..n-1) into row 0 of ``cache`` at the chunk's positions, keys re-rotated."""
        if not layer_kv:
            return
        key_cache, value_cache = cache.keys[layer][0], cache.values[layer][0]
        if not self.batched:  # chunk by chunk, straight into the cache (see the module docstring)
            cos, sin = self.tables
            offset = 0
            for (k, v), (start, end) in zip(layer_kv, self.spans, strict=True):
                rows = slice(offset, offset + end - start)
                Rope.apply_rerotation_into(key_cache[:, start:end], k, (cos[rows], sin[rows]))
                value_cache[:, start:end].copy_(v)
                offset = rows.stop
            return
        # (non_blocking: a pinned host layer copies while the host queues the next operations)
        keys = [k.to(self.device, non_blocking=True) for k, _ in layer_kv]
        values = [v.to(self.device, non_blocking=True) for _, v in layer_kv]
        k = keys[0] if len(keys) == 1 else torch.cat(keys, dim=1)
        v = values[0] if len(values) == 1 else torch.cat(values, dim=1)
        if self.index is None:  # back to back: rotated straight into the cache slice
            start, end = self.spans[0][0], self.spans[-1][1]
            Rope.apply_rerotation_into(key_cache[:, start:end], k, self.tables)
            value_cache[:, start:end].copy_(v)
            return
        rotated = torch.empty(k.shape, dtype=key_cache.dtype, device=self.device)
        Rope.apply_rerotation_into(rotated, k, self.tables)
        key_cache.index_copy_(1, self.index, rotated)
        value_cache.index_copy_(1, self.index, v.to(value_cache.dtype))
