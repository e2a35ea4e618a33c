"""Chunk-shift correction: what a chunk's recomputed tokens learn about the rest of it.

A chunk's KV was precomputed without the passages that precede it in the prompt, and that error is
largely shared by the chunk's tokens: at a given layer every token of a chunk misses the same earlier
passages, so its fresh key and value differ from the cached ones by a common shift plus a token's own
part. The tokens a method recomputes measure that shift for free: at each layer, the mean of (fresh -
cached) over a chunk's recomputed tokens is added to the chunk's tokens that keep their cached K/V — the
value change as it is, the key change in the keys' unrotated frame (each change rotated back from its
token's position, averaged, and turned to every position it is added at). A shared key shift moves the
attention every query pays the chunk as a whole; that, more than the values, is what a query reading a
chunk precomputed alone gets wrong (docs/fusor.md, "Chunk-shift correction").

A chunk with fewer than :data:`MIN_ROWS` recomputed tokens keeps its cached K/V as they are (one token's
change is mostly its own).
"""

from __future__ import annotations

import torch

from ..models.rope import Rope, apply_rotary
from .plan import FusionPlan

# the fewest recomputed tokens of a chunk whose mean change is applied to the rest of it
MIN_ROWS = 2


class ChunkShift:
    """One prompt's chunk-shift correction, built once per fusion and applied at every layer.

    Each layer's correction is a fixed number of tensor operations, whatever the number of chunks, and
    never reads a value back to the host: on an accelerator the host queues the next layer while this one
    runs (a loop over the chunks cost ~30 operations per chunk per layer and read back to the host twice)."""

    def __init__(self, plan: FusionPlan, rope: Rope, device: torch.device) -> None:
        spans = plan.chunk_spans()
        n = plan.num_tokens
        self.num_chunks = len(spans)
        chunk_of = torch.full((n,), len(spans), dtype=torch.long)  # len(spans): no chunk (zero shift)
        for index, (start, end) in enumerate(spans):
            chunk_of[start:end] = index
        # the positions a shift is added to: every position from the first chunk's start to the last one's
        # end, each with its chunk's row of the shift table (a position between chunks: the zero row)
        self.start, self.end = (spans[0][0], spans[-1][1]) if spans else (0, 0)
        self.region_chunk = chunk_of[self.start : self.end].to(device)
        chunk_of[~plan.candidate_mask] = len(spans)  # exact and must-compute positions are never measured
        self.chunk_of = chunk_of.to(device)
        self.no_chunk_slot = torch.arange(len(spans) + 1, device=device) == len(spans)
        # unscaled rotations (the keys carry any rope amplitude already): a change is rotated as a vector
        cos, sin = rope.cos_sin(torch.arange(n, device=device), torch.float32, scaled=False)
        self.cos, self.sin = cos, sin
        # the region's tables in the keys' dtype, halves only (they repeat over a head's two halves)
        self._region_tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rows: torch.Tensor | None = None
        self._per_rows: tuple[torch.Tensor, ...] = ()

    def region_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        found = self._region_tables.get(dtype)
        if found is None:
            half = self.cos.shape[-1] // 2
            found = (
                self.cos[self.start : self.end, :half].to(dtype),
                self.sin[self.start : self.end, :half].to(dtype),
            )
            self._region_tables[dtype] = found
        return found

    def apply(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        rows: torch.Tensor,
        fresh_k: torch.Tensor,
        fresh_v: torch.Tensor,
    ) -> None:
        """Shift the cached K/V of each chunk (``keys``/``values``: one layer's cache [Hkv, T, d], the
        chunks placed) by the mean change its recomputed rows show: ``rows`` (ascending positions)
        computed at this layer as ``fresh_k``/``fresh_v`` [Hkv, S, d] (keys rotated to ``rows``), before
        they are written over their cached K/V."""
        if not self.num_chunks:
            return
        chunk, cos_rows, minus_sin_rows, skipped, divisor = self._measured_by(rows)
        # (index_select: advanced indexing along a middle dimension is several times slower on CPU)
        delta_v = fresh_v.float() - values.index_select(1, rows).float()
        delta_k = fresh_k.float() - keys.index_select(1, rows).float()
        # each key change back to the unrotated frame: R(-p) x = x cos p - rotate_half(x) sin p
        delta_k = apply_rotary(delta_k, cos_rows, minus_sin_rows)
        heads, _, dim = delta_v.shape
        # keys' and values' changes side by side: one sum per chunk, one mean, one lookup per position
        delta = torch.cat((delta_k, delta_v), dim=-1)
        sums = torch.zeros(heads, self.num_chunks + 1, 2 * dim, device=rows.device).index_add_(
            1, chunk, delta
        )
        # per chunk its mean change, zero where too few rows measured it and in the last slot (no chunk)
        shift = (sums / divisor).masked_fill_(skipped, 0.0)
        # each position's row of the table, in the cache's dtype
        moves = shift.to(keys.dtype).index_select(1, self.region_chunk)  # [Hkv, R, 2d]
        dk, dv = moves[..., :dim], moves[..., dim:]
        # R(q) dk added in place at every position q of the region, rotate_half's halves written out: a
        # zero row adds nothing
        half = dim // 2
        cos, sin = self.region_tables(keys.dtype)
        moved = keys[:, self.start : self.end]
        moved[..., :half].addcmul_(dk[..., :half], cos).addcmul_(dk[..., half:], sin, value=-1)
        moved[..., half:].addcmul_(dk[..., half:], cos).addcmul_(dk[..., :half], sin)
        values[:, self.start : self.end] += dv

    def _measured_by(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What depends on the recomputed rows alone, the same at every layer until a method narrows them:
        each row's slot, its rotation tables, and per slot whether it is skipped and its divisor."""
        if self._rows is not rows:
            chunk = self.chunk_of[rows]  # a row outside every chunk sums into the last (discarded) slot
            counts = torch.bincount(chunk, minlength=self.num_chunks + 1)
            skipped = ((counts < MIN_ROWS) | self.no_chunk_slot)[None, :, None]
            self._rows = rows  # (held: the identity check above stays sound)
            self._per_rows = (
                chunk,
                self.cos[rows],
                -self.sin[rows],
                skipped,
                counts.clamp_min(1)[None, :, None],
            )
        return self._per_rows
