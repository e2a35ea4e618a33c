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
    """One prompt's chunk-shift correction, built once per fusion and applied at every layer."""

    def __init__(self, plan: FusionPlan, rope: Rope, device: torch.device) -> None:
        spans = plan.chunk_spans()
        n = plan.num_tokens
        chunk_of = torch.full((n,), len(spans), dtype=torch.long)  # len(spans): no chunk (zero shift)
        for index, (start, end) in enumerate(spans):
            chunk_of[start:end] = index
        chunk_of[~plan.candidate_mask] = len(spans)  # exact and must-compute positions are never moved
        self.num_chunks, self.spans = len(spans), spans
        self.chunk_of = chunk_of.to(device)
        # unscaled rotations (the keys carry any rope amplitude already): a change is rotated as a vector
        cos, sin = rope.cos_sin(torch.arange(n, device=device), torch.float32, scaled=False)
        self.cos, self.sin = cos, sin

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
        chunk = self.chunk_of[rows]
        inside = (chunk < self.num_chunks).nonzero().squeeze(1)
        if not inside.numel():
            return
        rows, chunk = rows.index_select(0, inside), chunk.index_select(0, inside)
        # (index_select: advanced indexing along a middle dimension is several times slower on CPU)
        delta_v = fresh_v.index_select(1, inside).float() - values.index_select(1, rows).float()
        delta_k = fresh_k.index_select(1, inside).float() - keys.index_select(1, rows).float()
        # each key change back to the unrotated frame: R(-p) x = x cos p - rotate_half(x) sin p
        delta_k = apply_rotary(delta_k, self.cos[rows], -self.sin[rows])
        heads, _, dim = delta_v.shape
        counts = torch.bincount(chunk, minlength=self.num_chunks)
        shift_k = torch.zeros(heads, self.num_chunks, dim, device=rows.device).index_add_(1, chunk, delta_k)
        shift_v = torch.zeros_like(shift_k).index_add_(1, chunk, delta_v)
        half = dim // 2
        for index, ((start, end), count) in enumerate(zip(self.spans, counts.tolist(), strict=True)):
            if count < MIN_ROWS:
                continue
            dk = (shift_k[:, index : index + 1] / count).to(keys.dtype)  # [Hkv, 1, d]
            dv = (shift_v[:, index : index + 1] / count).to(values.dtype)
            # R(q) dk added in place for every q of the chunk, rotate_half's halves written out (the
            # tables repeat over the halves): no temporary the size of the chunk's keys
            cos, sin = self.cos[start:end, :half].to(keys.dtype), self.sin[start:end, :half].to(keys.dtype)
            moved = keys[:, start:end]
            moved[..., :half].addcmul_(dk[..., :half], cos).addcmul_(dk[..., half:], sin, value=-1)
            moved[..., half:].addcmul_(dk[..., half:], cos).addcmul_(dk[..., :half], sin)
            values[:, start:end] += dv
