"""Exact causal attention for queries at any positions of a sequence (models/runtime.py's kernels).

A full prefill is SDPA's causal kernel; queries at the last slot (decode) need no mask; contiguous queries
after cached keys (a prefix-cache hit, a chunk behind its context) are two flash calls merged through their
log-sum-exps; ascending scattered positions (a CacheBlend selection) are attended in row blocks
(:class:`RowBlock`). :class:`AttentionMask` says which shape a forward has, built once and shared by all
its layers; :func:`attend` runs the kernel for it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

# Ascending query positions (a CacheBlend selection) are attended in row blocks. A block's rows all see the
# keys before its first row's position: on CPU that rectangle is one unmasked flash-attention call, and only
# the window from its first row's position to its last row's is masked (two calls merged by log-sum-exp;
# grouped-query heads packed as rows, so each call has many rows per KV head). Elsewhere (CUDA) a block is
# one masked call over the keys up to its last row. At most ATTENTION_ROW_BLOCKS blocks of at least
# ATTENTION_BLOCK_ROWS rows: on this Intel Xeon (2 threads, the default's real selections of 490 / 957 rows
# of 3,132 / 6,210 positions) 6 such blocks attend in 12.4 / 49.2 ms per layer, where 16 masked blocks
# took 14.7 / 61.2 ms (scripts/row_block_attention.py at 929a489).
ATTENTION_ROW_BLOCKS = 6
ATTENTION_BLOCK_ROWS = 64


class RowBlock(NamedTuple):
    """Rows ``start..end-1`` of a selection: every one sees keys ``0..seen-1`` (the positions before its
    first row), and keys ``seen..key_end-1`` only up to its own position."""

    start: int
    end: int
    seen: int
    key_end: int


def row_blocks(positions: torch.Tensor, count: int) -> tuple[RowBlock, ...]:
    """Ascending ``positions`` cut into ``count`` blocks of (nearly) equal rows."""
    bounds = torch.linspace(0, positions.numel(), count + 1).long().tolist()
    return tuple(
        RowBlock(start, end, int(positions[start]), int(positions[end - 1]) + 1)
        for start, end in itertools.pairwise(bounds)
        if end > start
    )


@dataclass(frozen=True)
class AttentionMask:
    """Exact causal visibility for queries at given positions over keys at slots 0..T-1.

    Built once per forward and shared by all layers. The two common shapes need no mask tensor: a full
    prefill (queries 0..T-1, SDPA's own causal kernel) and queries that all sit at the last slot (decode).
    Ascending positions of one sequence come with ``blocks`` (:class:`RowBlock`).
    """

    tensor: torch.Tensor | None
    is_causal: bool
    blocks: tuple[RowBlock, ...] = ()
    # queries are the contiguous positions suffix_start..T-1 (a prefix-cache hit, a chunk prefilled behind
    # its context): on CPU attended as the keys before them, unmasked, merged with a causal square
    suffix_start: int | None = None
    # ``tensor`` as an additive float mask per dtype (and each block's window of it per dtype and head
    # group), made on first use and kept for every layer (SDPA would otherwise convert the boolean mask
    # again at each call)
    _additive: dict = field(default_factory=dict, compare=False, repr=False)

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        """``tensor`` as 0 where visible and -inf elsewhere, in ``dtype``."""
        found = self._additive.get(dtype)
        if found is None:
            found = torch.zeros(self.tensor.shape, dtype=dtype, device=self.tensor.device)
            found.masked_fill_(~self.tensor, float("-inf"))
            self._additive[dtype] = found
        return found

    def windows(self, dtype: torch.dtype, groups: int) -> list[torch.Tensor | None]:
        """Each block's additive mask over its window (keys ``seen..key_end-1``), its rows repeated once
        per query head of a KV group as :func:`row_block_attention` packs them: [1, 1, groups * rows,
        window]; None for a block with ``seen == 0`` (attended as one grouped-query call, unrepeated)."""
        key = (dtype, groups)
        found = self._additive.get(key)
        if found is None:
            additive = self.additive(dtype)
            found = [
                additive[:, :, b.start : b.end, b.seen : b.key_end].repeat(1, 1, groups, 1).contiguous()
                if b.seen
                else None
                for b in self.blocks
            ]
            self._additive[key] = found
        return found

    @classmethod
    def for_positions(cls, positions: torch.Tensor, key_length: int) -> AttentionMask:
        blocks: tuple[RowBlock, ...] = ()
        if positions.dim() == 1:
            if positions.numel() == key_length and bool(
                (positions == torch.arange(key_length, device=positions.device)).all()
            ):
                return cls(None, True)
            if bool((positions == key_length - 1).all()):
                return cls(None, False)
            start = key_length - positions.numel()
            if (
                positions.device.type == "cpu"
                and positions.numel() > 1
                and bool((positions == torch.arange(start, key_length, device=positions.device)).all())
            ):
                return cls(None, False, suffix_start=start)
            if positions.numel() > 1 and bool((positions[1:] > positions[:-1]).all()):
                count = max(1, min(ATTENTION_ROW_BLOCKS, positions.numel() // ATTENTION_BLOCK_ROWS))
                blocks = row_blocks(positions, count)
            positions = positions[None]
        key_positions = torch.arange(key_length, device=positions.device)
        # [B, 1, S, T]: the query at position p sees the keys at positions 0..p
        return cls(key_positions[None, None, None, :] <= positions[:, None, :, None], False, blocks)


def suffix_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scaling: float
) -> torch.Tensor:
    """Exact causal attention of queries at positions start..T-1 over keys 0..T-1, as two fast CPU
    kernels: every query sees keys 0..start-1 (no mask), and keys start..T-1 form a causal square; the two
    softmaxes are merged through their log-sum-exps. A boolean mask over the whole rectangle runs the
    masked kernel, about 1.5x slower here."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    seen, seen_lse = flash_with_lse(q, keys[:, :, :start], values[:, :, :start], scaling)
    own, own_lse = flash_with_lse(q, keys[:, :, start:], values[:, :, start:], scaling, causal=True)
    return merge_attention(seen, seen_lse, own, own_lse).to(q.dtype)


def masked_block_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: AttentionMask,
    block: RowBlock,
    scaling: float,
) -> torch.Tensor:
    """One block's rows in one masked grouped-query SDPA call over the keys up to its last row."""
    return F.scaled_dot_product_attention(
        q[:, :, block.start : block.end],
        keys[:, :, : block.key_end],
        values[:, :, : block.key_end],
        attn_mask=mask.additive(q.dtype)[:, :, block.start : block.end, : block.key_end],
        scale=scaling,
        enable_gqa=True,
    )


def row_block_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: AttentionMask, scaling: float
) -> torch.Tensor:
    """Exact attention of a selection's rows (``mask.blocks``) on CPU: per block, the keys every row sees
    (an unmasked flash call) and the window after them (a masked one), merged through their log-sum-exps;
    each KV head's query heads packed as rows ([1, Hkv, groups * rows, d]), which the kernel attends faster
    than grouped-query heads (see :data:`ATTENTION_ROW_BLOCKS`). A block no key of which every row sees
    (``seen == 0``) is one masked grouped-query call, whatever its mask. Returns [1, H, S, d]."""
    heads, kv_heads, d = q.shape[1], keys.shape[1], q.shape[3]
    groups = heads // kv_heads
    outs = []
    for block, window in zip(mask.blocks, mask.windows(q.dtype, groups), strict=True):
        if window is None:  # no key every row sees: one masked call (a mask of any shape, e.g. a round's)
            outs.append(masked_block_attention(q, keys, values, mask, block, scaling))
            continue
        rows = block.end - block.start
        packed = q[:, :, block.start : block.end].reshape(1, kv_heads, groups * rows, d)
        k_window, v_window = keys[:, :, block.seen : block.key_end], values[:, :, block.seen : block.key_end]
        out, lse = flash_with_lse(packed, k_window, v_window, scaling, mask=window)
        seen, seen_lse = flash_with_lse(packed, keys[:, :, : block.seen], values[:, :, : block.seen], scaling)
        out = merge_attention(seen, seen_lse, out, lse).to(q.dtype)
        outs.append(out.reshape(1, heads, rows, d))
    return torch.cat(outs, dim=2)


def flash_with_lse(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention of ``q`` [B, H, S, d] over ``keys``/``values`` with as many heads (the kernel
    has no grouped-query heads): its output [B, H, S, d] and log-sum-exp [B, H, S], which
    :func:`merge_attention` needs and no public SDPA call returns. ``mask``: additive or boolean."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = kernel(q, keys, values, is_causal=causal, attn_mask=mask, scale=scale)[:2]
    return out, lse


def merge_attention(
    first: torch.Tensor, first_lse: torch.Tensor, second: torch.Tensor, second_lse: torch.Tensor
) -> torch.Tensor:
    """The attention output over two disjoint sets of keys from each set's own output [B, H, S, d] and
    log-sum-exp [B, H, S]: the softmaxes re-weighted to one (a row must see a key in at least one set)."""
    top = torch.maximum(first_lse, second_lse)
    first_w, second_w = torch.exp(first_lse - top).unsqueeze(-1), torch.exp(second_lse - top).unsqueeze(-1)
    return (first * first_w + second * second_w) / (first_w + second_w)


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: AttentionMask, scaling: float
) -> torch.Tensor:
    """Attention of ``q`` [B, H, S, d] over ``keys``/``values`` [B, Hkv, T, d] under ``mask``, by the
    fastest exact kernel for its shape: [B, H, S, d]."""
    if mask.is_causal:
        # SDPA's causal CPU kernel is about twice as fast on materialised heads as with enable_gqa
        groups = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scaling)
    if mask.suffix_start is not None:
        return suffix_attention(q, keys, values, mask.suffix_start, scaling)
    if mask.blocks and q.device.type == "cpu":
        return row_block_attention(q, keys, values, mask, scaling)
    if mask.blocks:
        return torch.cat(
            [masked_block_attention(q, keys, values, mask, b, scaling) for b in mask.blocks], dim=2
        )
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask.tensor, scale=scaling, enable_gqa=True
    )
