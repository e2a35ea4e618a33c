"""The static fusion's steps: one probe layer, one blend layer, the selection, the chunk-shift tables.

Each is a function of tensors whose shapes the host fixed (:mod:`.static_layout`): no module calls, no
Python state, no value read back to the host, no shape that depends on data. A graph compiler traces each
once per size bucket and replays it at every layer (the layer's weights are inputs, not constants), and
the host queues a whole fusion without waiting for the device.

The chunk-shift correction (:mod:`.shift`) is a handful of kernels whatever the number of chunks: each
chunk's mean change is one product of an averaging matrix (built once per selection: which recomputed row
measures which chunk, divided by the chunk's count, zero for a chunk with fewer than ``MIN_ROWS`` of them)
with the rows' changes, then spread to every position by one index.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..models.fused import FusedWeights, LayerWeights, finish, heads_to_rows, project, rotate
from .shift import MIN_ROWS


class ShiftInputs(NamedTuple):
    """What the chunk-shift correction needs for one selection of rows (:func:`shift_inputs`)."""

    average: torch.Tensor  # [C1b, S] float32: chunk c's mean over the rows that measure it
    unrotate: tuple[torch.Tensor, torch.Tensor]  # [S, d] float32 cos and signed sin of R(-p)
    move_slot: torch.Tensor  # [Tb] the chunk each position moves with (the zero slot for none)
    rotate: tuple[torch.Tensor, torch.Tensor]  # [Tb, d] in the cache's dtype: R(q) of every position


def place(
    keys: torch.Tensor,
    values: torch.Tensor,
    chunk_k: torch.Tensor,
    chunk_v: torch.Tensor,
    index: torch.Tensor,
    rerotation: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Every cached row of a layer (``chunk_k``/``chunk_v`` [Hkv, Ncb, d], rotated to each chunk's own
    positions) written at its prompt position ``index`` [Ncb], keys re-rotated there (float32 tables)."""
    cos, sin_signed = rerotation
    rotated = rotate(chunk_k.float(), cos, sin_signed)
    keys.index_copy_(1, index, rotated.to(keys.dtype))
    values.index_copy_(1, index, chunk_v.to(values.dtype))


def place_layers(
    storage: torch.Tensor,
    staged: torch.Tensor,
    index: torch.Tensor,
    rerotation: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """:func:`place` for every layer at once: ``staged`` [L, 2, Hkv, Ncb, d] (each layer's cached K and V
    joined) into ``storage`` [L, 2, 1, Hkv, Tb, d] at positions ``index``, keys re-rotated (float32)."""
    cos, sin_signed = rerotation
    rotated = rotate(staged[:, 0].float(), cos, sin_signed)
    storage[:, 0, 0].index_copy_(2, index, rotated.to(storage.dtype))
    storage[:, 1, 0].index_copy_(2, index, staged[:, 1].to(storage.dtype))


def probe_layer(
    w: LayerWeights,
    fw: FusedWeights,
    hidden: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    query_weight: torch.Tensor,
    scores: tuple[torch.Tensor, torch.Tensor],
    finish_layer: bool,
) -> torch.Tensor:
    """One probe layer of the fresh rows (``hidden`` [M, D] at ``rows``) over the layer's K/V (cached
    rows placed): their K/V written, float32 attention probabilities (``mask`` [1, g M, Tb]), the query
    rows' mass (``query_weight`` [g M]) added to ``scores`` (per KV head [Hkv, Tb]: attention, and the
    same times each value's norm) and, when ``finish_layer``, the rows' output from those probabilities."""
    q, k, v = project(w, hidden, *tables, fw)
    keys.index_copy_(1, rows, k)
    values.index_copy_(1, rows, v)
    m = hidden.shape[0]
    grouped = q.reshape(fw.kv_heads, -1, fw.head_dim).float()
    logits = torch.baddbmm(mask, grouped, keys.float().transpose(1, 2), alpha=fw.head_dim**-0.5)
    probabilities = torch.softmax(logits, dim=-1)
    mass = torch.matmul(query_weight, probabilities)  # [Hkv, Tb]
    attention, contribution = scores
    attention.add_(mass)
    contribution.addcmul_(mass, torch.linalg.vector_norm(values.float(), dim=-1))
    if not finish_layer:
        return hidden
    out = torch.bmm(probabilities, values.float()).view(fw.heads, m, fw.head_dim)
    return finish(w, hidden, heads_to_rows(out).to(hidden.dtype), fw)


def apply_shift(
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shift: ShiftInputs,
) -> None:
    """Move every chunk's cached K/V by the mean change its recomputed ``rows`` show (fresh ``k``/``v``
    [Hkv, S, d] against the cached ones at those rows), key changes averaged in the unrotated frame."""
    delta_k = k.float() - keys.index_select(1, rows).float()
    delta_v = v.float() - values.index_select(1, rows).float()
    delta = torch.cat((rotate(delta_k, *shift.unrotate), delta_v), dim=-1)  # [Hkv, S, 2d]
    means = torch.matmul(shift.average, delta)  # [Hkv, C1b, 2d]
    moves = means.index_select(1, shift.move_slot).to(keys.dtype)  # [Hkv, Tb, 2d]
    d = keys.shape[-1]
    keys.add_(rotate(moves[..., :d], *shift.rotate))
    values.add_(moves[..., d:])


def blend_layer(
    w: LayerWeights,
    fw: FusedWeights,
    hidden: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    shift: ShiftInputs | None,
    last_row: torch.Tensor | None = None,
) -> torch.Tensor:
    """One blend layer of the selected rows (``hidden`` [S, D] at ``rows``): the chunk shift (when given),
    their fresh K/V over the cached ones, exact attention under ``mask`` [1, 1, S, Tb] (one call), the rest
    of the layer. ``last_row`` [1]: only that row's output is needed (the last layer)."""
    q, k, v = project(w, hidden, *tables, fw)
    if shift is not None:
        apply_shift(keys, values, rows, k, v, shift)
    keys.index_copy_(1, rows, k)
    values.index_copy_(1, rows, v)
    if last_row is not None:
        hidden, q = hidden.index_select(0, last_row), q.index_select(1, last_row)
        mask = mask.index_select(2, last_row)
    out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, enable_gqa=True)
    return finish(w, hidden, heads_to_rows(out[0]).to(hidden.dtype), fw)


def causal_mask(rows: torch.Tensor, keys: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask of ``rows`` over slots 0..keys-1 (a row at p sees 0..p): [S, keys]."""
    visible = torch.arange(keys, device=rows.device)[None, :] <= rows[:, None]
    return torch.zeros((), dtype=dtype, device=rows.device).masked_fill(~visible, float("-inf"))


def select_top(
    scores: torch.Tensor,
    candidate_bias: torch.Tensor,
    budget: torch.Tensor,
    fresh_rows: torch.Tensor,
    size: int,
    dummy: int,
) -> torch.Tensor:
    """The fresh rows and the ``budget`` best candidates by ``scores`` [Tb], ascending: [M + size] (a
    device top-k of the bucket's ``size``; places past ``budget`` [] go to the dummy slot)."""
    top = torch.topk(scores + candidate_bias, size).indices
    kept = torch.arange(size, device=top.device) < budget
    return torch.sort(torch.cat((fresh_rows, torch.where(kept, top, dummy)))).values


def narrow(
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    row_bias: torch.Tensor,
    fresh_rows: torch.Tensor,
    budget: torch.Tensor,
    size: int,
    signal: str,
    dummy: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HKVD's check: of ``rows``, the fresh ones and the ``budget`` cached ones whose fresh K (or V) moved
    most from the cached one (squared distance over heads and dims; ``row_bias`` [S]: 0 for a cached row,
    -inf for a fresh or padded one). Returns the new rows (ascending, [M + size]) and where each sits in
    ``rows`` (to carry its hidden state and q)."""
    fresh, cached = (k, keys) if signal == "k" else (v, values)
    deviation = (fresh.float() - cached.index_select(1, rows).float()).square().sum(dim=(0, 2))
    top = rows.index_select(0, torch.topk(deviation + row_bias, size).indices)
    kept = torch.arange(size, device=top.device) < budget
    chosen = torch.sort(torch.cat((fresh_rows, torch.where(kept, top, dummy)))).values
    where = torch.searchsorted(rows, chosen).clamp_max(rows.numel() - 1)
    return chosen, where


def shift_inputs(
    rows: torch.Tensor,
    measure_slot: torch.Tensor,
    move_slot: torch.Tensor,
    chunks: int,
    no_chunk: torch.Tensor,
    unrotate: tuple[torch.Tensor, torch.Tensor],
    rotate_tables: tuple[torch.Tensor, torch.Tensor],
) -> ShiftInputs:
    """The correction's tables for ``rows``: which chunk each measures, each chunk's divisor, the rows'
    R(-p) tables (``unrotate``: every position's float32 cos and signed sin, indexed here)."""
    slot = measure_slot.index_select(0, rows)
    slots = torch.arange(chunks, device=rows.device)[:, None]
    onehot = (slot[None, :] == slots).float()  # [C1b, S]
    counts = onehot.sum(dim=1, keepdim=True)
    usable = (counts >= MIN_ROWS) & (slots < no_chunk)
    average = onehot * (usable / counts.clamp_min(1))
    cos, sin_signed = unrotate
    return ShiftInputs(
        average,
        (cos.index_select(0, rows), -sin_signed.index_select(0, rows)),
        move_slot,
        rotate_tables,
    )


def check_layer(
    w: LayerWeights,
    fw: FusedWeights,
    hidden: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    narrowing: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, str],
    rope_tables: tuple[torch.Tensor, torch.Tensor],
    shift: ShiftInputs | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """An HKVD check layer: every row's K/V computed and written, the rows narrowed (:func:`narrow`,
    ``narrowing`` = its row bias, fresh rows, budget, size and signal), and the chosen rows alone attend
    and finish the layer. Returns their hidden states, positions, RoPE tables and mask. ``shift`` (after an
    earlier check has left cached rows): the correction of the rows computed here, measured against the
    cached K/V after the deviation is, as the layer passes order them."""
    q, k, v = project(w, hidden, *tables, fw)
    row_bias, fresh_rows, budget, size, signal = narrowing
    dummy = keys.shape[1] - 1
    chosen, where = narrow(k, v, keys, values, rows, row_bias, fresh_rows, budget, size, signal, dummy)
    if shift is not None:
        apply_shift(keys, values, rows, k, v, shift)
    keys.index_copy_(1, rows, k)
    values.index_copy_(1, rows, v)
    hidden, q = hidden.index_select(0, where), q.index_select(1, where)
    tables = (rope_tables[0].index_select(0, chosen), rope_tables[1].index_select(0, chosen))
    mask = causal_mask(chosen, keys.shape[1], hidden.dtype)[None, None]
    out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, enable_gqa=True)
    return finish(w, hidden, heads_to_rows(out[0]).to(hidden.dtype), fw), chosen, tables, mask
