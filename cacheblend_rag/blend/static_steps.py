"""The static fusion's steps: one probe layer, one blend layer, an HKVD check layer, the selection, the
chunk-shift tables.

Each is a function of tensors whose shapes the host fixed (:mod:`.static_layout`): no module calls, no
Python state, no value read back to the host, no shape that depends on data. A graph compiler traces each
once per size bucket and replays it at every layer (the layer's weights are inputs, not constants), and
the host queues a whole fusion without waiting for the device.

A layer's K and V live side by side (``kv`` [2, Hkv, Tb, d], a view of the fusion's one cache tensor), so
one indexed write stores both, and RoPE writes q, k and v head-major (:func:`project_heads`): q grouped
by KV head is then a view, not a copy. The chunk-shift correction is :mod:`.static_shift`'s.

Two probe variants: ``fast`` (a low-precision model: bf16 products with float32 results, only the query
rows scored, their output by the fused attention kernel) and the float32 one, whose probabilities and
output are the layer passes' (:mod:`.probe`) operation for operation, so a CPU fusion selects the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.fused import FusedWeights, LayerWeights, finish, heads_to_rows
from .static_shift import LayerShift, ShiftInputs, apply_shift, shift_inputs


def head_tables(
    rope_tables: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor, fw: FusedWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables of ``rows`` for every head group of the packed q/k/v ([S, G, 1, d], G = H/Hkv + 2):
    the position's rotation for the q and k groups, the identity for v (cos 1, sin 0)."""
    groups = fw.heads // fw.kv_heads + 1
    cos, sin_signed = (table.index_select(0, rows)[:, None, None, :] for table in rope_tables)
    ones = torch.ones((), dtype=cos.dtype, device=cos.device).expand(rows.numel(), 1, 1, cos.shape[-1])
    return (
        torch.cat((cos.expand(-1, groups, -1, -1), ones), dim=1),
        torch.cat((sin_signed.expand(-1, groups, -1, -1), ones * 0), dim=1),
    )


def project_heads(
    w: LayerWeights, hidden: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], fw: FusedWeights
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input norm, one q/k/v product and one RoPE of all heads (v by the identity) written head-major:
    q [H, S, d], kv [2, Hkv, S, d] (contiguous views of one buffer) and the product's raw k/v columns
    [S, 2 Hkv d] (k before RoPE: the shift's unrotated frame)."""
    rows, d = hidden.shape[0], fw.head_dim
    x = F.rms_norm(hidden, hidden.shape[-1:], w.input_norm, fw.eps)
    qkv = F.linear(x, w.qkv, w.qkv_bias)
    # every operand viewed head-major ([G, Hkv, S, d]), so the result written there is contiguous
    grouped = qkv.view(rows, -1, fw.kv_heads, d).permute(1, 2, 0, 3)
    half = d // 2
    swapped = torch.cat((grouped[..., half:], grouped[..., :half]), dim=-1)
    cos, sin_signed = (table.permute(1, 2, 0, 3) for table in tables)
    out = qkv.new_empty(grouped.shape)
    torch.addcmul(grouped * cos, swapped, sin_signed, out=out)
    out = out.view(-1, rows, d)
    return out[: fw.heads], out[fw.heads :].view(2, fw.kv_heads, rows, d), qkv[:, fw.heads * d :]


def rerotate(staged: torch.Tensor, rerotation: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The keys of ``staged`` [L, Hkv, 2, N, d] (cached rows joined, each chunk's keys rotated to its own
    positions) re-rotated in place to their prompt positions by float32 tables [>= N, d]."""
    keys = staged[:, :, 0]
    rows, half = keys.shape[-2], keys.shape[-1] // 2
    swapped = torch.cat((keys[..., half:], keys[..., :half]), dim=-1)
    cos, sin_signed = (table[:rows] for table in rerotation)
    torch.addcmul(keys * cos, swapped, sin_signed, out=keys)


def place_layers(
    storage: torch.Tensor,
    staged: torch.Tensor,
    index: torch.Tensor,
    rerotation: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Cached rows of several layers placed at once: ``staged`` [L, Hkv, 2, Ncb, d] (consumed: its keys
    are re-rotated in place, :func:`rerotate`) into ``storage`` [L, 2, 1, Hkv, Tb, d] at ``index``."""
    rerotate(staged, rerotation)
    storage[:, :, 0].index_copy_(3, index, staged.transpose(1, 2))


def _scores(mask: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention logits in float32 of ``q`` [Hkv, R, d] over ``keys`` [Hkv, Tb, d] plus ``mask``: a
    low-precision product with float32 results where the device has one, else from float32 copies."""
    if q.dtype == torch.float32 or q.device.type == "cpu":
        return torch.baddbmm(mask, q.float(), keys.float().transpose(1, 2), alpha=scale)
    return torch.add(mask, torch.bmm(q, keys.transpose(1, 2), out_dtype=torch.float32), alpha=scale)


def probe_layer(
    w: LayerWeights,
    fw: FusedWeights,
    hidden: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
    rows: torch.Tensor,
    kv: torch.Tensor,
    masks: tuple[torch.Tensor, torch.Tensor],
    query_weight: torch.Tensor,
    mass: torch.Tensor,
    finish_layer: bool,
    fast: bool,
) -> torch.Tensor:
    """One probe layer of the fresh rows (``hidden`` [M, D] at ``rows``) over the layer's ``kv`` (cached
    rows placed): their K/V written, the query rows' attention mass (``query_weight`` over the scored
    rows) written to ``mass`` [Hkv, Tb] and, when ``finish_layer``, the rows' output. ``masks``: the
    scored rows' float32 mask [1, g R, Tb] and, for ``fast``, every row's [1, 1, M, Tb]; ``fast`` scores
    the last R rows only (R = ``query_weight``'s length / g) and takes the output from the attention
    kernel, else every row is scored and the output is those probabilities times the values."""
    q, fresh, _ = project_heads(w, hidden, tables, fw)
    kv.index_copy_(2, rows, fresh)
    keys, values = kv[0], kv[1]
    m, groups = hidden.shape[0], fw.heads // fw.kv_heads
    scored = query_weight.numel() // groups
    grouped = q[:, m - scored :].reshape(fw.kv_heads, groups * scored, fw.head_dim)
    probabilities = torch.softmax(_scores(masks[0], grouped, keys, fw.head_dim**-0.5), dim=-1)
    torch.matmul(query_weight, probabilities, out=mass)
    if not finish_layer:
        return hidden
    if fast:
        out = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=masks[1], enable_gqa=True
        )
        attended = heads_to_rows(out[0])
    else:
        out = torch.bmm(probabilities, values.float()).view(fw.heads, m, fw.head_dim)
        attended = heads_to_rows(out).to(hidden.dtype)
    return finish(w, hidden, attended, fw)


def blend_layer(
    w: LayerWeights,
    fw: FusedWeights,
    hidden: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
    rows: torch.Tensor,
    kv: torch.Tensor,
    mask: torch.Tensor,
    shift: LayerShift | None,
    last_row: torch.Tensor | None = None,
) -> torch.Tensor:
    """One blend layer of the selected rows (``hidden`` [S, D] at ``rows``): the chunk shift (when given),
    their fresh K/V over the cached ones, exact attention under ``mask`` [1, 1, S, Tb] (one call), the rest
    of the layer. ``last_row`` [1]: only that row's output is needed (the last layer)."""
    q, fresh, raw = project_heads(w, hidden, tables, fw)
    if shift is not None:
        apply_shift(kv, raw, shift)
    kv.index_copy_(2, rows, fresh)
    if last_row is not None:
        hidden, q = hidden.index_select(0, last_row), q.index_select(1, last_row)
        mask = mask.index_select(2, last_row)
    out = F.scaled_dot_product_attention(q[None], kv[0][None], kv[1][None], attn_mask=mask, enable_gqa=True)
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
    fresh: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    row_bias: torch.Tensor,
    fresh_rows: torch.Tensor,
    budget: torch.Tensor,
    size: int,
    signal: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HKVD's check: of ``rows``, the fresh ones and the ``budget`` cached ones whose fresh K (or V) moved
    most from the cached one (squared distance over heads and dims; ``row_bias`` [S]: 0 for a cached row,
    -inf for a fresh or padded one). Returns the new rows (ascending, [M + size]) and where each sits in
    ``rows`` (to carry its hidden state and q)."""
    side = 0 if signal == "k" else 1
    cached = kv[side].index_select(1, rows)
    deviation = (fresh[side].float() - cached.float()).square().sum(dim=(0, 2))
    top = rows.index_select(0, torch.topk(deviation + row_bias, size).indices)
    kept = torch.arange(size, device=top.device) < budget
    chosen = torch.sort(torch.cat((fresh_rows, torch.where(kept, top, kv.shape[2] - 1)))).values
    where = torch.searchsorted(rows, chosen).clamp_max(rows.numel() - 1)
    return chosen, where


def check_layer(
    w: LayerWeights,
    fw: FusedWeights,
    hidden: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
    rows: torch.Tensor,
    kv: torch.Tensor,
    narrowing: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, str],
    rope_tables: tuple[torch.Tensor, torch.Tensor],
    shift: LayerShift | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """An HKVD check layer: every row's K/V computed and written, the rows narrowed (:func:`narrow`,
    ``narrowing`` = its row bias, fresh rows, budget, size and signal), and the chosen rows alone attend
    and finish the layer. Returns their hidden states, positions, RoPE tables and mask. ``shift`` (after an
    earlier check has left cached rows): the correction of the rows computed here, measured against the
    cached K/V after the deviation is, as the layer passes order them."""
    q, fresh, raw = project_heads(w, hidden, tables, fw)
    row_bias, fresh_rows, budget, size, signal = narrowing
    chosen, where = narrow(fresh, kv, rows, row_bias, fresh_rows, budget, size, signal)
    if shift is not None:
        apply_shift(kv, raw, shift)
    kv.index_copy_(2, rows, fresh)
    hidden, q = hidden.index_select(0, where), q.index_select(1, where)
    tables = head_tables(rope_tables, chosen, fw)
    mask = causal_mask(chosen, kv.shape[2], hidden.dtype)[None, None]
    out = F.scaled_dot_product_attention(q[None], kv[0][None], kv[1][None], attn_mask=mask, enable_gqa=True)
    return finish(w, hidden, heads_to_rows(out[0]).to(hidden.dtype), fw), chosen, tables, mask


__all__ = [
    "LayerShift",
    "ShiftInputs",
    "blend_layer",
    "causal_mask",
    "check_layer",
    "head_tables",
    "narrow",
    "place_layers",
    "probe_layer",
    "project_heads",
    "rerotate",
    "select_top",
    "shift_inputs",
]
