"""How far a fused cache is from full prefill: KV deviation and attention deviation per layer.

Attention deviation follows the paper: the forward attention of the tokens that every method computes
(the question and generation prompt) is recorded at each layer, under the fused cache and under full
prefill, and compared (L2 over keys, averaged over heads and query tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.attention import AttentionMask
from ..models.runtime import KVCache
from .fusor import Fusor
from .methods import FullRecompute, RecomputeMethod
from .segments import Segment


class AttentionRecorder:
    """A fusor observer that keeps the attention probabilities of ``query_positions`` at each layer."""

    def __init__(self, query_positions: torch.Tensor, scaling: float) -> None:
        self.query_positions = query_positions
        self.scaling = scaling
        self.by_layer: dict[int, torch.Tensor] = {}

    def __call__(
        self, layer: int, positions: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, mask: AttentionMask
    ) -> None:
        rows = torch.searchsorted(positions, self.query_positions.to(positions.device))
        q_rows = q[0, :, rows].float()  # [H, m, d]
        k = keys[0].float().repeat_interleave(q_rows.shape[0] // keys.shape[1], dim=0)  # [H, T, d]
        scores = q_rows @ k.transpose(1, 2) * self.scaling
        visible = torch.arange(k.shape[1], device=k.device)[None, :] <= self.query_positions[:, None].to(
            k.device
        )
        self.by_layer[layer] = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)


@dataclass
class Deviation:
    """Per-layer attention and KV deviation of one method against full prefill on one prompt."""

    attention: list[float]
    kv: list[float]
    recompute_ratio: float

    @property
    def mean_attention(self) -> float:
        return sum(self.attention) / len(self.attention)

    @property
    def mean_kv(self) -> float:
        return sum(self.kv) / len(self.kv)


def kv_deviation(fused: KVCache, reference: KVCache, length: int) -> list[float]:
    """Per layer, ||K_f - K_ref|| + ||V_f - V_ref|| over the prompt, relative to ||K_ref|| + ||V_ref||."""
    out = []
    for kf, kr, vf, vr in zip(fused.keys, reference.keys, fused.values, reference.values, strict=True):
        kf, kr, vf, vr = (t[:, :, :length].float() for t in (kf, kr, vf, vr))
        out.append(float(((kf - kr).norm() + (vf - vr).norm()) / (kr.norm() + vr.norm())))
    return out


def measure_deviation(
    fusor: Fusor, segments: list[Segment], methods: list[RecomputeMethod], query_tokens: int | None = None
) -> list[Deviation]:
    """Fuse ``segments`` with full prefill and with each method; return each method's deviation.

    ``query_tokens`` (default: the whole last fresh segment) are the positions whose attention is compared.
    """
    n = sum(len(s) for s in segments)
    m = query_tokens or len(segments[-1])
    queries = torch.arange(n - m, n)
    scaling = fusor.model.scaling
    reference_rec = AttentionRecorder(queries, scaling)
    reference = fusor.fuse(segments, FullRecompute(), observer=reference_rec)
    results = []
    for method in methods:
        recorder = AttentionRecorder(queries, scaling)
        fused = fusor.fuse(segments, method, observer=recorder)
        attention = [
            float((recorder.by_layer[layer] - reference_rec.by_layer[layer]).norm(dim=-1).mean())
            for layer in sorted(reference_rec.by_layer)
        ]
        results.append(
            Deviation(attention, kv_deviation(fused.cache, reference.cache, n), fused.recompute_ratio)
        )
    return results
