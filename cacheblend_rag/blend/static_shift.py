"""The static fusion's chunk-shift correction (:mod:`.shift`): four kernels per layer, whatever the chunks.

At each layer every chunk's cached K/V move by the mean change its recomputed rows show, key changes
averaged in the keys' unrotated frame. Both ends are rearranged so a layer's share is two products:

- measuring: the change of a row is its fresh K/V minus its cached K/V. The fresh key unrotated is the
  q/k/v product's raw k column (RoPE undone is RoPE not applied), so one product of the rows' chunk
  one-hot with the raw k/v columns gives every chunk's fresh sums; the cached rows' sums (unrotated) are
  made once per selection for every remaining layer (:func:`shift_inputs`, one product for all layers)
  and subtracted in the same product. The sums times each chunk's 1 / count (zero for a chunk with fewer
  than ``MIN_ROWS`` rows, and for the no-chunk slot) are the means.
- moving: each chunk's mean key turns to every position of the chunk (R(q) per RoPE frequency is a 2 x 2
  rotation) and the value mean is added as it is: one batched product of per-position 2 x 2 tables
  (:func:`shift_spread`, built once per prompt) with the means, one indexed add into the layer's cache.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .shift import MIN_ROWS


class LayerShift(NamedTuple):
    """One layer's share of :class:`ShiftInputs`."""

    onehot: torch.Tensor  # [C1b, S] in the model's dtype: the chunk slot each recomputed row measures
    cached: torch.Tensor  # [C1b, 2 Hkv d] float32: per slot the sums of its rows' cached K (unrotated), V
    scale: torch.Tensor  # [1, 2, C1b, 1, 1] float32: per side 1 / rows per slot (0: the mean not applied)
    spread: torch.Tensor  # [d/2 2 C1b, 2 N, 2]: per frequency, side, chunk and position a 2 x 2 table
    index: torch.Tensor  # [C1b N]: each chunk's positions (the dummy slot past its end)
    moves: torch.Tensor  # [d/2, 2, C1b, 2, Hkv] scratch: the means per frequency, side, chunk, pair


class ShiftInputs(NamedTuple):
    """The correction's tensors for one selection of rows, for the layers from the one it was made at."""

    onehot: torch.Tensor
    cached: torch.Tensor  # [L', C1b, 2 Hkv d]
    scale: torch.Tensor
    spread: torch.Tensor
    index: torch.Tensor
    moves: torch.Tensor

    def layer(self, offset: int) -> LayerShift:
        """The share of the ``offset``-th layer from the first one these inputs cover."""
        return LayerShift(self.onehot, self.cached[offset], self.scale, self.spread, self.index, self.moves)


def shift_spread(
    shift_tables: tuple[torch.Tensor, torch.Tensor],
    chunk_index: torch.Tensor,
    chunks: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Per RoPE frequency i, side, chunk c and position (n, a) of the chunk: the 2 x 2 table taking a
    mean's (a', i) pair to the position, R(q) for keys and the identity for values, as
    [d/2 2 C, 2 N, a'] (``shift_tables``: every slot's float32 unscaled cos and signed sin;
    ``chunk_index`` [C N])."""
    half = shift_tables[0].shape[-1] // 2
    cos = shift_tables[0].index_select(0, chunk_index)[:, :half].t()
    sin = shift_tables[1].index_select(0, chunk_index)[:, half:].t()
    one = torch.ones((), device=cos.device).expand_as(cos)
    # a key's row a is (cos, -sin) or (sin, cos); a value's is the identity's
    keys = torch.stack((cos, -sin, sin, cos), dim=-1)  # [d/2, C N, (a, a')]
    values = torch.stack((one, one * 0, one * 0, one), dim=-1)
    return torch.stack((keys, values), dim=1).to(dtype).view(half * 2 * chunks, -1, 2)


def shift_unrotate(shift_tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Every slot's R(-p) as tables for both sides, [2 (cos, sin), 2 (k, v), Tb, d]: the keys' cos and
    minus signed sin, the values' identity."""
    cos, minus_sin = shift_tables[0], -shift_tables[1]
    one = torch.ones((), device=cos.device).expand_as(cos)
    return torch.stack((cos, one, minus_sin, one * 0)).view(2, 2, *cos.shape)


def shift_inputs(
    rows: torch.Tensor,
    layers: torch.Tensor,
    measure_slot: torch.Tensor,
    chunks: int,
    unrotate: torch.Tensor,
    spread: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    amplitude: float = 1.0,
) -> ShiftInputs:
    """The correction's tensors for ``rows`` [S] and the layers of ``layers`` [L', 2, 1, Hkv, cap, d]
    (their cached rows placed, none of them blended yet): which slot each row measures, each slot's
    scale, and per layer the cached rows' sums (``unrotate``: :func:`shift_unrotate`'s tables).
    ``spread``: :func:`shift_spread`'s tables, the chunks' positions and the scratch of
    :class:`LayerShift`. ``amplitude``: the RoPE amplitude keys carry (a raw k column is 1 / amplitude
    of the unrotated key)."""
    slot = measure_slot.index_select(0, rows)
    onehot = (slot[None, :] == torch.arange(chunks, device=rows.device)[:, None]).float()  # [C1b, S]
    counts = onehot.sum(dim=1)
    scale = torch.where(counts >= MIN_ROWS, counts.reciprocal(), 0)[None, None, :, None, None]
    scale = scale.expand(-1, 2, -1, -1, -1)
    if amplitude != 1.0:  # sums of raw k less cached keys / amplitude, times amplitude
        scale = scale * torch.tensor([amplitude, 1.0], device=scale.device)[None, :, None, None, None]
    # the cached rows of every layer, keys unrotated, values as they are
    # (every operand viewed [L', S, 2, Hkv, d]: the result is laid out as the product wants it)
    gathered = layers[:, :, 0].index_select(3, rows).permute(0, 3, 1, 2, 4)
    cos, minus_sin = unrotate.index_select(2, rows).permute(0, 2, 1, 3)[:, :, :, None]  # [S, 2, 1, d]
    if amplitude != 1.0:
        cos, minus_sin = cos / amplitude, minus_sin / amplitude
    half = gathered.shape[-1] // 2
    swapped = torch.cat((gathered[..., half:], gathered[..., :half]), dim=-1)
    unrotated = gathered.new_empty(gathered.shape, dtype=torch.float32)
    torch.addcmul(gathered * cos, swapped, minus_sin, out=unrotated)
    count, size = unrotated.shape[:2]
    cached = torch.bmm(onehot.expand(count, -1, -1), unrotated.view(count, size, -1))
    tables, index, moves = spread
    return ShiftInputs(onehot.to(layers.dtype), cached, scale, tables, index, moves)


def _sums(cached: torch.Tensor, onehot: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """Per slot the sums of fresh (raw) minus cached K/V: ``onehot`` @ ``raw`` - ``cached``, float32."""
    if raw.dtype == torch.float32 or raw.device.type == "cpu":
        return torch.addmm(cached, onehot.float(), raw.float(), beta=-1)
    return torch.addmm(cached, onehot, raw, out_dtype=torch.float32, beta=-1)


def apply_shift(kv: torch.Tensor, raw: torch.Tensor, shift: LayerShift) -> None:
    """Move every chunk's cached K/V in ``kv`` [2, Hkv, Tb, d] by the mean change its recomputed rows
    show: ``raw`` [S, 2 Hkv d] is their q/k/v product's k/v columns (k before RoPE), measured against
    the cached K/V at those rows (as :attr:`LayerShift.cached` holds them)."""
    sides, heads, keys, dim = kv.shape
    half, chunks = dim // 2, shift.onehot.shape[0]
    sums = _sums(shift.cached, shift.onehot, raw)  # [C1b, (side, head, a, i)]
    means = sums.view(chunks, sides, heads, 2, half).permute(4, 1, 0, 3, 2)  # [i, side, c, a, head]
    torch.mul(means, shift.scale, out=shift.moves)
    moved = torch.bmm(shift.spread, shift.moves.view(-1, 2, heads))  # [i side c, (n, a), head]
    moved = moved.view(half, sides, -1, 2, heads).permute(1, 4, 2, 3, 0)  # [side, head, C N, a, i]
    kv.view(sides, heads, keys, 2, half).index_add_(2, shift.index, moved)


def shift_scratch(chunks: int, kv_heads: int, head_dim: int, dtype, device) -> torch.Tensor:
    """:attr:`LayerShift.moves` (each layer writes all of it)."""
    return torch.empty((head_dim // 2, 2, chunks, 2, kv_heads), dtype=dtype, device=device)


__all__ = [
    "LayerShift",
    "ShiftInputs",
    "apply_shift",
    "shift_inputs",
    "shift_scratch",
    "shift_spread",
    "shift_unrotate",
]
