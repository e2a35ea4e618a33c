"""Position-independent caching (PIC) methods: which tokens does the fusor recompute at each layer?

A method answers two questions: which positions are computed at layer 0, and, at the layers it declares
as check layers, which of the positions computed so far continue. Everything a method does not select
keeps its cached KV. Tokens outside cached chunks (template, separators, question) and the last prompt
token are always computed, whatever the method.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..errors import FusionInputError
from .segments import Segment


@dataclass
class FusionPlan:
    """The token layout of one request: where each segment lands and which positions are cached."""

    segments: list[Segment]
    token_ids: torch.Tensor  # [T]
    cached_mask: torch.Tensor  # [T] bool: position belongs to a cached segment
    must_compute: torch.Tensor  # [T] bool: fresh text plus the last prompt token
    spans: list[tuple[int, int]]  # [start, end) of every segment

    @classmethod
    def from_segments(cls, segments: list[Segment]) -> FusionPlan:
        if not segments or sum(len(s) for s in segments) == 0:
            raise FusionInputError("nothing to fuse: the prompt has no tokens")
        spans, start = [], 0
        for segment in segments:
            spans.append((start, start + len(segment)))
            start += len(segment)
        cached = torch.zeros(start, dtype=torch.bool)
        for segment, (s, e) in zip(segments, spans, strict=True):
            cached[s:e] = segment.is_cached
        must = ~cached
        must[-1] = True  # next-token logits need the last token's hidden state at every layer
        ids = torch.tensor([t for s in segments for t in s.token_ids], dtype=torch.long)
        return cls(segments, ids, cached, must, spans)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.numel()

    @property
    def num_cached(self) -> int:
        return int((self.cached_mask & ~self.must_compute).sum())

    def cached_spans(self) -> list[tuple[int, int]]:
        return [span for seg, span in zip(self.segments, self.spans, strict=True) if seg.is_cached]


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
        cached norm so neither dominates)."""

        def dev(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
            return (fresh.float() - cached.float()).pow(2).sum(dim=(0, 2))

        if signal == "k":
            return dev(self.fresh_k, self.cached_k)
        if signal == "v":
            return dev(self.fresh_v, self.cached_v)
        if signal == "kv":
            k_scale = self.cached_k.float().pow(2).sum(dim=(0, 2)).mean().clamp_min(1e-6)
            v_scale = self.cached_v.float().pow(2).sum(dim=(0, 2)).mean().clamp_min(1e-6)
            return dev(self.fresh_k, self.cached_k) / k_scale + dev(self.fresh_v, self.cached_v) / v_scale
        raise ValueError(f"unknown deviation signal {signal!r}: use 'k', 'v' or 'kv'")


class RecomputeMethod(ABC):
    """The PIC-method interface the fusor applies. Subclass it and :func:`register_method` to add one."""

    name: ClassVar[str]

    @abstractmethod
    def layer0_positions(self, plan: FusionPlan) -> torch.Tensor:
        """Positions computed at layer 0 (ascending; must include every ``plan.must_compute`` position)."""

    def check_layers(self, plan: FusionPlan) -> tuple[int, ...]:
        """Layers at which :meth:`select` narrows the recomputed set; none by default."""
        return ()

    def select(self, state: LayerState) -> torch.Tensor:
        """Positions, a subset of ``state.candidates`` (with all must-compute ones), that go on."""
        return state.candidates

    def describe(self) -> dict:
        return {"method": self.name}


def _all_positions(plan: FusionPlan) -> torch.Tensor:
    return torch.arange(plan.num_tokens)


class FullRecompute(RecomputeMethod):
    """Every token at every layer: the quality reference, equal to full prefill."""

    name = "full_recompute"

    def layer0_positions(self, plan: FusionPlan) -> torch.Tensor:
        return _all_positions(plan)


class FullReuse(RecomputeMethod):
    """PromptCache-style: cached chunks keep their KV at every layer; only fresh text is computed."""

    name = "full_reuse"

    def layer0_positions(self, plan: FusionPlan) -> torch.Tensor:
        return plan.must_compute.nonzero().squeeze(1)


class PrefixCache(RecomputeMethod):
    """Exact prefix reuse as vLLM/SGLang do: only a cached segment at position 0 is reused (its KV is
    the prompt's own prefix KV); everything after it is computed."""

    name = "prefix_cache"

    def layer0_positions(self, plan: FusionPlan) -> torch.Tensor:
        keep = plan.must_compute.clone()
        first = plan.segments[0]
        reused_end = plan.spans[0][1] if first.is_cached else 0
        keep[reused_end:] = True
        return keep.nonzero().squeeze(1)


@dataclass
class Epic(RecomputeMethod):
    """EPIC's attention-sink fix: recompute the first ``k`` tokens of every cached chunk, plus fresh text."""

    k: int = 16
    name: ClassVar[str] = "epic"

    def layer0_positions(self, plan: FusionPlan) -> torch.Tensor:
        keep = plan.must_compute.clone()
        for start, end in plan.cached_spans():
            keep[start : min(end, start + self.k)] = True
        return keep.nonzero().squeeze(1)

    def describe(self) -> dict:
        return {"method": self.name, "k": self.k}


# Check layers and the share of cached tokens kept at each, as multiples of the final ratio r (the last
# entry is r itself). Chosen by measurement; see docs/fusor.md.
DEFAULT_SCHEDULE: tuple[tuple[int, float], ...] = ((1, 1.0),)


@dataclass
class CacheBlend(RecomputeMethod):
    """CacheBlend: layer 0 computes every token; at each check layer the cached candidates with the
    highest KV deviation (HKVD) are kept, narrowing gradually to ``ratio`` of the cached tokens, which
    are recomputed at every later layer."""

    ratio: float = 0.15
    signal: str = "k"
    schedule: tuple[tuple[int, float], ...] = field(default=DEFAULT_SCHEDULE)
    name: ClassVar[str] = "cacheblend"

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"recompute ratio must be in [0, 1], got {self.ratio}")
        layers = [layer for layer, _ in self.schedule]
        if not layers or layers != sorted(set(layers)):
            raise ValueError("schedule needs at least one check layer, in increasing layer order")
        if self.schedule[0][0] < 1:
            raise ValueError("the first check layer must be >= 1 (layer 0 is always computed in full)")

    def layer0_positions(self, plan: FusionPlan) -> torch.Tensor:
        return _all_positions(plan)

    def check_layers(self, plan: FusionPlan) -> tuple[int, ...]:
        return tuple(layer for layer, _ in self.schedule)

    def select(self, state: LayerState) -> torch.Tensor:
        multiple = dict(self.schedule)[state.layer]
        is_last = state.layer == self.schedule[-1][0]
        share = self.ratio if is_last else min(1.0, self.ratio * multiple)
        must = state.plan.must_compute[state.candidates]
        budget = math.ceil(share * state.plan.num_cached - 1e-9)
        cached_candidates = (~must).nonzero().squeeze(1)
        if budget >= cached_candidates.numel():
            return state.candidates
        deviation = state.deviation(self.signal)[cached_candidates]
        top = (
            cached_candidates[torch.topk(deviation, budget).indices] if budget > 0 else cached_candidates[:0]
        )
        keep = torch.cat([must.nonzero().squeeze(1), top])
        return state.candidates[keep.sort().values]

    def describe(self) -> dict:
        return {
            "method": self.name,
            "ratio": self.ratio,
            "signal": self.signal,
            "schedule": list(self.schedule),
        }


_REGISTRY: dict[str, Callable[..., RecomputeMethod]] = {}


def register_method(name: str, factory: Callable[..., RecomputeMethod]) -> None:
    """Make a method available by name to the engine, CLI and integrations."""
    _REGISTRY[name] = factory


def get_method(name: str, **options) -> RecomputeMethod:
    """Instantiate a registered method, e.g. ``get_method("cacheblend", ratio=0.2)``."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(available_methods())}") from None
    return factory(**options)


def available_methods() -> list[str]:
    return sorted(_REGISTRY)


for _method in (FullRecompute, FullReuse, PrefixCache):
    register_method(_method.name, lambda _cls=_method, **_: _cls())
register_method(Epic.name, lambda k=16, **_: Epic(k=k))
register_method(
    CacheBlend.name,
    lambda ratio=0.15, signal="k", schedule=DEFAULT_SCHEDULE, **_: CacheBlend(ratio, signal, tuple(schedule)),
)
