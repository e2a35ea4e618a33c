"""The token layout the fusor works on, and what a method sees at a check layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import FusionInputError
from .segments import Segment


@dataclass
class FusionPlan:
    """The token layout of one request: where each segment lands and which positions are cached."""

    segments: list[Segment]
    token_ids: torch.Tensor  # [T]
    cached_mask: torch.Tensor  # [T] bool: position belongs to a cached segment
    must_compute: torch.Tensor  # [T] bool: fresh text plus the last prompt token (unless no logits)
    spans: list[tuple[int, int]]  # [start, end) of every segment
    exact_mask: torch.Tensor  # [T] bool: cached with the prompt's own KV (never worth recomputing)
    # Attention the question paid each position in the query probe ([T]); set by the fusor before
    # layer0_positions for methods that ask for it (see blend/probe.py), None otherwise.
    query_attention: torch.Tensor | None = None
    # the same weighted by each position's value norm at each layer (ProbeResult.contribution)
    query_contribution: torch.Tensor | None = None
    # the next token's logits ([V]) at the probe's last prompt row, over the cached chunks as they are
    # (full reuse's first-token distribution); set only for methods that ask (RecomputeMethod.probe_logits)
    probe_logits: torch.Tensor | None = None

    @classmethod
    def from_segments(cls, segments: list[Segment], *, logits: bool = True) -> FusionPlan:
        """The layout of ``segments``. ``logits``: whether the next token's logits are wanted, which
        needs the last token computed at every layer; without them (a round's blend, whose members
        compute their own) a cached last token is a candidate like any other, so the blend's budget is
        the one each member would get alone."""
        if not segments or sum(len(s) for s in segments) == 0:
            raise FusionInputError("nothing to fuse: the prompt has no tokens")
        # per-token flags from Python lists: one tensor each, whatever the number of segments
        spans, cached_flags, exact_flags, start = [], [], [], 0
        for segment in segments:
            spans.append((start, start + len(segment)))
            start += len(segment)
            cached_flags += [segment.is_cached] * len(segment)
            exact_flags += [segment.is_cached and segment.exact] * len(segment)
        cached = torch.tensor(cached_flags, dtype=torch.bool)
        exact = torch.tensor(exact_flags, dtype=torch.bool)
        must = ~cached
        if logits:
            must[-1] = True  # next-token logits need the last token's hidden state at every layer
            exact[-1] = False
        ids = torch.tensor([t for s in segments for t in s.token_ids], dtype=torch.long)
        return cls(segments, ids, cached, must, spans, exact)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.numel()

    @property
    def num_cached(self) -> int:
        """Cached positions a method may choose to recompute (exact ones and must-compute ones aside):
        what a recompute ratio is a share of."""
        return int(self.candidate_mask.sum())

    @property
    def candidate_mask(self) -> torch.Tensor:
        """[T] bool: cached positions whose KV is reusable but not exact, i.e. worth recomputing."""
        return self.cached_mask & ~self.must_compute & ~self.exact_mask

    def cached_spans(self) -> list[tuple[int, int]]:
        """[start, end) of every cached segment, exact ones included (every span whose KV is placed)."""
        return [span for seg, span in zip(self.segments, self.spans, strict=True) if seg.is_cached]

    def chunk_spans(self) -> list[tuple[int, int]]:
        """[start, end) of the cached segments whose KV is not exact: the chunks a method blends."""
        return [
            span
            for seg, span in zip(self.segments, self.spans, strict=True)
            if seg.is_cached and not seg.exact
        ]


@dataclass
class LayerState:
    """What a method sees at a check layer: this layer's fresh K/V for the candidate positions (those
    computed at the previous layer) beside the cached K/V at the same positions."""

    layer: int
    plan: FusionPlan
    candidates: torch.Tensor  # [S] positions, ascending
    fresh_k: torch.Tensor  # [Hkv, S, d], rotated to the candidates' positions
    fresh_v: torch.Tensor
    cached_k: torch.Tensor  # [Hkv, S, d], re-rotated to the same positions
    cached_v: torch.Tensor

    def deviation(self, signal: str = "v") -> torch.Tensor:
        """Per-candidate squared L2 deviation of fresh from cached K, V, or both (each scaled by its mean
        cached norm so neither dominates), on the candidates' device (the plan's, the CPU), computed on the
        K/V's (an accelerator's), so that methods may index candidates with it."""

        def dev(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
            return (fresh.float() - cached.float()).pow(2).sum(dim=(0, 2))

        if signal == "k":
            deviation = dev(self.fresh_k, self.cached_k)
        elif signal == "v":
            deviation = dev(self.fresh_v, self.cached_v)
        elif signal == "kv":
            k_scale = self.cached_k.float().pow(2).sum(dim=(0, 2)).mean().clamp_min(1e-6)
            v_scale = self.cached_v.float().pow(2).sum(dim=(0, 2)).mean().clamp_min(1e-6)
            deviation = (
                dev(self.fresh_k, self.cached_k) / k_scale + dev(self.fresh_v, self.cached_v) / v_scale
            )
        else:
            raise ValueError(f"unknown deviation signal {signal!r}: use 'k', 'v' or 'kv'")
        return deviation.to(self.candidates.device)
