"""One decoder layer for several fusion passes at once.

A pass (one request's fusion, or its query probe) computes some of its prompt's tokens at every layer.
Q/K/V projections, o-proj and MLP work token by token, so the tokens of several passes are stacked into
one batch for them; attention stays per pass, over that pass's own cache with its own exact mask. A pass
says what happens between the projections and attention (writing K/V, placing cached chunks, narrowing
its tokens at a check layer, recording attention) in :meth:`LayerPass.attention_inputs`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..models.attention import AttentionMask
from ..models.runtime import LayerwiseModel


class LayerPass(Protocol):
    """The state one fusion pass carries from layer to layer."""

    hidden: torch.Tensor  # [1, S, D]: the tokens this pass computes at the coming layer
    positions: torch.Tensor  # [S] their prompt positions
    cos_sin: tuple[torch.Tensor, torch.Tensor]  # RoPE tables of those positions

    def attention_inputs(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMask]:
        """Given this layer's fresh q/k/v of the pass's tokens, write what the cache needs and return
        (q, keys, values, mask) to attend with; may narrow ``hidden``/``positions`` (and q with them)."""
        ...

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        """Attention output [1, S, H * d] of what :meth:`attention_inputs` returned (a pass that already
        has its attention probabilities reuses them; others call ``LayerwiseModel.attend``)."""
        ...


@torch.inference_mode()
def run_layer(model: LayerwiseModel, layer: int, passes: list[LayerPass], finish: bool = True) -> None:
    """Layer ``layer`` for every pass: projections and MLP over all their tokens at once, attention per
    pass. ``finish=False`` stops before attention (a probe's last layer: only its K/V and what the pass
    records from q/k/v are needed, never its output)."""
    if len(passes) == 1:
        only = passes[0]
        hidden, positions, (cos, sin) = only.hidden, only.positions, only.cos_sin
    else:
        hidden = torch.cat([p.hidden for p in passes], dim=1)
        positions = torch.cat([p.positions for p in passes])
        cos = torch.cat([p.cos_sin[0] for p in passes])
        sin = torch.cat([p.cos_sin[1] for p in passes])
    qkv = model.project_qkv(layer, hidden, positions, (cos, sin))
    attended = []
    start = 0
    for one in passes:
        rows = slice(start, start + one.hidden.shape[1])
        start = rows.stop
        q, keys, values, mask = one.attention_inputs(
            layer, qkv.q[:, :, rows], qkv.k[:, :, rows], qkv.v[:, :, rows]
        )
        if finish:
            attended.append(one.attend(q, keys, values, mask))
    if not finish:
        return
    # a pass down to one row (a fusion's last layer: only its last token's output is read) finishes on
    # its own: one row's products then run the same kernel whether or not other passes share the layer
    # (a GEMM over more rows may take another kernel, summing in another order)
    finished = list(zip(passes, attended, strict=True))
    stacked = [pair for pair in finished if pair[0].hidden.shape[1] > 1]
    for group in [*([pair] for pair in finished if pair[0].hidden.shape[1] <= 1), stacked]:
        if group:
            _finish_together(model, layer, group)


def _finish_together(model: LayerwiseModel, layer: int, group: list[tuple[LayerPass, torch.Tensor]]) -> None:
    """o-proj, residual, norm and MLP of ``group``'s passes (each with its attention output), their rows
    stacked into one batch."""
    if len(group) == 1:
        one, out = group[0]
        one.hidden = model.finish_layer(layer, one.hidden, out)
        return
    sizes = [one.hidden.shape[1] for one, _ in group]
    out = model.finish_layer(
        layer,
        torch.cat([one.hidden for one, _ in group], dim=1),
        torch.cat([part for _, part in group], dim=1),
    )
    for (one, _), part in zip(group, out.split(sizes, dim=1), strict=True):
        one.hidden = part
