"""CacheBlend's two selection rules, one method each: :class:`CacheBlend` (``cacheblend``, the default)
recomputes the cached tokens the question attends to most; :class:`CacheBlendHKVD` (``cacheblend_hkvd``,
the paper's rule) those whose fresh K or V deviates most from the cached one at its check layers.

Both reuse every cached chunk's KV but the ``ratio`` share of its tokens they recompute (fresh text is
always computed) and, with ``shift`` (default on), move every chunk's kept K/V at each layer by the mean
change its recomputed tokens show there (blend/shift.py).

``cacheblend@...,selection=hkvd`` is an older spelling of ``cacheblend_hkvd@...``; the registry respells
it (:meth:`CacheBlend.respelled`), with a deprecation warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, field_validator, model_validator

from ..config import DEFAULT_RATIO
from .budget import (
    BUDGET_HELP,
    FLAT_OPTIONS,
    FLAT_SPELLING,
    AdaptiveBudget,
    Budget,
    FixedBudget,
    MarginBudget,
    fold_flat_budget,
    request_budget,
    spelled_budget,
)
from .budget_choice import BudgetChoice
from .methods import RecomputeMethod, RoundSharing, register_method, share_budget
from .plan import FusionPlan, LayerState
from .static_layout import DeviationNarrowing, HostRows, QueryTopK, StaticSelection

# Check layers and the share of cached tokens kept at each, as multiples of the final ratio r (the last
# entry is r itself), for HKVD selection. See docs/fusor.md.
DEFAULT_SCHEDULE: tuple[tuple[int, float], ...] = ((1, 1.0),)

_QUERY_OPTIONS = ("score", "budget", "probe_depth", "chunk_rows", "chunk_starts", *FLAT_OPTIONS)
_HKVD_OPTIONS = ("signal", "schedule")


def _ratio() -> Any:
    return Field(DEFAULT_RATIO, ge=0.0, le=1.0, description="share of cached tokens recomputed, in [0, 1]")


def _shift() -> Any:
    return Field(
        True,
        description="correct every chunk's kept cached K/V by the mean change its recomputed tokens show "
        "at the same layer (keys in their unrotated frame): the chunk-shift correction; false: off",
    )


class _Blend(RecomputeMethod):
    """What both rules share: the round sharing a blend allows and the chunk-shift switch."""

    shorthand = "ratio"
    ratio_option = "ratio"

    if TYPE_CHECKING:  # fields of each rule, declared there in the order its options are listed
        ratio: float
        shift: bool

    def shifts_chunks(self) -> bool:
        return self.shift

    def round_sharing(self) -> RoundSharing:
        # r = 1 promises each request its own full prefill: a shared blend keeps it only for requests
        # whose text before the chunks is the round's own; with the chunk-shift correction the blend holds
        # for the round's chunk order only (tests/blend/test_round.py: an agent with its own order read
        # the shifted blend with 2x full reuse's first-token KL)
        if self.ratio >= 1.0:
            return RoundSharing.SAME_PREFIX
        return RoundSharing.SAME_ORDER if self.shift else RoundSharing.ANY


class CacheBlend(_Blend):
    """CacheBlend with query-aware selection: the cached tokens the question attends to most.

    A probe pass computes only the fresh text over the cached KV and records where the question's tokens
    look, summed over layers and heads (blend/probe.py); the best of the cached tokens by ``score`` are
    then recomputed from layer 0, as many as ``budget`` says (by default the ``ratio`` share).
    """

    name = "cacheblend"
    spelled_options = frozenset({"selection", *FLAT_OPTIONS})
    options_elsewhere = dict.fromkeys(_HKVD_OPTIONS, "cacheblend_hkvd")

    ratio: float = _ratio()
    score: Literal["attention", "contribution"] = Field(
        "contribution",
        description="rank by the attention the question pays a token, or by that attention times the "
        "token's value norm (its contribution to the attention output)",
    )
    budget: Budget = Field(FixedBudget(), description=BUDGET_HELP)
    probe_depth: int = Field(
        0,
        ge=0,
        le=4096,
        description="score the question's attention over the first N layers only (a cheaper probe, a "
        "different selection); 0 (default) scores every layer",
    )
    shift: bool = _shift()
    chunk_rows: int = Field(
        0,
        ge=0,
        le=4096,
        description="with shift only: each chunk's best N tokens by the question's reading are recomputed "
        "first, out of the same budget, so that every chunk has rows to measure its shift by; 0 "
        "(default): the budget's best tokens wherever they are",
    )

    chunk_starts: int = Field(
        0,
        ge=0,
        le=4096,
        description="each chunk's first N cached tokens are recomputed first, out of the same budget; 0 "
        "(default): none by position",
    )

    @classmethod
    def respelled(cls, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
        # `selection` chose between the two rules when they were one method
        if "selection" not in options:
            return None
        rest = {key: value for key, value in options.items() if key != "selection"}
        if options["selection"] == "query":
            return cls.name, rest
        if options["selection"] == "hkvd":
            warnings.warn(
                "cacheblend with selection=hkvd is deprecated: name the method cacheblend_hkvd, with the "
                "same options but selection (e.g. cacheblend_hkvd@ratio=0.15)",
                DeprecationWarning,
                stacklevel=4,
            )
            return CacheBlendHKVD.name, rest
        return None  # refused by the class, naming the values it takes

    @model_validator(mode="before")
    @classmethod
    def _flat_spelling(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        selection = data.get("selection", "query")
        if selection != "query":
            raise ValueError(
                f"selection={selection!r}: the paper's deviation selection is its own method, "
                "cacheblend_hkvd (CacheBlendHKVD); cacheblend's selection is always the query's"
            )
        return fold_flat_budget({key: value for key, value in data.items() if key != "selection"})

    @field_validator("budget", mode="before")
    @classmethod
    def _budget_kind(cls, value: Any) -> Any:
        return spelled_budget(value)

    @model_validator(mode="after")
    def _margin_needs_every_layer(self) -> CacheBlend:
        if isinstance(self.budget, MarginBudget) and self.probe_depth:
            raise ValueError("budget 'margin' needs a probe of every layer (probe_depth 0)")
        return self

    def spec_options(self, given: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
        # a budget is labelled flat, as specs have always named it (results are keyed by the label)
        options: list[tuple[str, Any]] = []
        for key, value in given.items():
            if key == "budget":
                options.append((key, FLAT_SPELLING[self.budget.kind]))
                if not isinstance(value, str):  # a typed budget: the options it set, named flat
                    set_ = self.budget.model_fields_set
                    options += [
                        (option, getattr(self.budget, option))
                        for option in type(self.budget).model_fields
                        if option != "kind" and option in set_ and option not in given
                    ]
            elif key in FLAT_OPTIONS:
                options.append((key, getattr(self.budget, key)))
            else:
                options.append((key, getattr(self, key)))
        return tuple(options)

    def uses_query_attention(self, plan: FusionPlan) -> bool:
        return True

    def request_choice(self, chunk_lengths: Sequence[int]) -> BudgetChoice | None:
        if not isinstance(self.budget, AdaptiveBudget):
            return None
        chosen, share = self.budget.choose(chunk_lengths, self.ratio)
        mean = sum(chunk_lengths) / len(chunk_lengths) if chunk_lengths else 0.0
        return BudgetChoice(
            **chosen.model_dump(),
            ratio=round(share, 6),
            short=self.budget.is_short(chunk_lengths),
            chunks=len(chunk_lengths),
            mean_chunk_tokens=round(mean, 1),
        )

    def probe_layers(self, num_layers: int) -> int:
        return min(self.probe_depth, num_layers) if self.probe_depth else num_layers

    def probe_logits(self) -> bool:
        return isinstance(self.budget, MarginBudget)

    def layer0_positions(self, plan: FusionPlan) -> torch.Tensor:
        keep = plan.must_compute.clone()
        cached = plan.candidate_mask.nonzero().squeeze(1)
        count = min(share_budget(self.ratio, plan), cached.numel())
        score = plan.query_attention if self.score == "attention" else plan.query_contribution
        if count and score is not None:
            ranked = torch.sort(score[cached], descending=True)
            count = self.budget.tokens(count, ranked.values, self.ratio, plan)
            floor = self._floor(score, count, plan)
            if floor is None:
                keep[cached[ranked.indices[:count]]] = True
            else:  # the floor first, then the best of the rest up to the budget
                keep[floor] = True
                rest = ranked.indices[~keep[cached[ranked.indices]]]
                keep[cached[rest[: count - floor.numel()]]] = True
        elif count:  # no probe ran (nothing cached to look at): every candidate is recomputed
            keep[cached] = True
        return keep.nonzero().squeeze(1)

    def _floor(self, score: torch.Tensor, budget: int, plan: FusionPlan) -> torch.Tensor | None:
        """The cached tokens recomputed before the budget's best: each chunk's first ``chunk_starts``
        and (with shift) its best ``chunk_rows``, within the budget; None when neither is asked."""
        parts = [self._chunk_starts(budget, plan) if self.chunk_starts else None]
        if self.shift and self.chunk_rows:
            parts.append(self._chunk_floor(score, budget, plan))
        found = [part for part in parts if part is not None]
        if not found:
            return None
        return torch.unique(torch.cat(found))[:budget]

    def _chunk_starts(self, budget: int, plan: FusionPlan) -> torch.Tensor | None:
        """Each chunk's first ``chunk_starts`` cached tokens (fewer when the budget cannot give every chunk
        as many): where a chunk prefilled apart was read as a beginning, and in the prompt is not."""
        spans = plan.chunk_spans()
        per_chunk = min(self.chunk_starts, budget // max(len(spans), 1))
        if not spans or per_chunk <= 0:
            return None
        picks = [torch.arange(start, end)[plan.candidate_mask[start:end]][:per_chunk] for start, end in spans]
        return torch.cat(picks)

    def _chunk_floor(self, score: torch.Tensor, budget: int, plan: FusionPlan) -> torch.Tensor | None:
        """The chunk floor: each chunk's best ``chunk_rows`` cached tokens by ``score`` (fewer when the
        budget cannot give every chunk as many). A chunk with fewer than 2 recomputed tokens keeps its
        cached K/V unshifted (blend/shift.py); a chunk the question reads little would otherwise get
        none, while its error moves what every query pays it. Where every chunk already has that many
        among the budget's best tokens, the selection is the same as without the floor."""
        spans = plan.chunk_spans()
        per_chunk = min(self.chunk_rows, budget // max(len(spans), 1))
        if not spans or per_chunk <= 0:
            return None
        picks = []
        for start, end in spans:
            span = torch.arange(start, end)[plan.candidate_mask[start:end]]
            if span.numel():
                best = torch.topk(score[span], min(per_chunk, span.numel())).indices
                picks.append(span[best])
        return torch.cat(picks) if picks else None

    def static_selection(self, plan: FusionPlan, num_layers: int) -> StaticSelection | None:
        chosen, share = request_budget(self.budget, plan, self.ratio)
        if not isinstance(chosen, FixedBudget) or self.chunk_rows or self.chunk_starts:
            return None  # sizes read from the probe's scores or spread by chunk
        budget = min(share_budget(share, plan), plan.num_cached) if self.ratio > 0 else 0
        if budget == 0:
            return HostRows(plan.must_compute.nonzero().squeeze(1))
        if budget == plan.num_cached:  # every candidate: no probe needed to choose among them
            return HostRows((plan.must_compute | plan.candidate_mask).nonzero().squeeze(1))
        return QueryTopK(budget, self.score, self.probe_layers(num_layers))


class CacheBlendHKVD(_Blend):
    """CacheBlend with the paper's HKVD selection: layer 0 computes every token; at each check layer of
    ``schedule`` the cached tokens whose fresh K (or V, ``signal``) deviates most from the cached one go
    on, the last check keeping the ``ratio`` share."""

    name = "cacheblend_hkvd"
    options_elsewhere = dict.fromkeys(_QUERY_OPTIONS, "cacheblend")

    ratio: float = _ratio()
    signal: Literal["k", "v", "kv"] = Field("k", description="deviation of K, V or both (each normalised)")
    schedule: tuple[tuple[int, float], ...] = Field(
        DEFAULT_SCHEDULE, description="check layers and their share as multiples of ratio: [[layer, x], ...]"
    )
    shift: bool = _shift()

    @model_validator(mode="after")
    def _check_schedule(self) -> CacheBlendHKVD:
        layers = [layer for layer, _ in self.schedule]
        if not layers or layers != sorted(set(layers)):
            raise ValueError("schedule needs at least one check layer, in increasing layer order")
        if layers[0] < 1:
            raise ValueError("the first check layer must be >= 1 (layer 0 is always computed in full)")
        return self

    def layer0_positions(self, plan: FusionPlan) -> torch.Tensor:
        return (~plan.exact_mask).nonzero().squeeze(1)

    def check_layers(self, plan: FusionPlan) -> tuple[int, ...]:
        return tuple(layer for layer, _ in self.schedule)

    def _share(self, layer: int, multiple: float) -> float:
        return self.ratio if layer == self.schedule[-1][0] else min(1.0, self.ratio * multiple)

    def select(self, state: LayerState) -> torch.Tensor:
        share = self._share(state.layer, dict(self.schedule)[state.layer])
        must = state.plan.must_compute[state.candidates]
        budget = share_budget(share, state.plan)
        cached_candidates = (~must).nonzero().squeeze(1)
        if budget >= cached_candidates.numel():
            return state.candidates
        deviation = state.deviation(self.signal)[cached_candidates]
        top = (
            cached_candidates[torch.topk(deviation, budget).indices] if budget > 0 else cached_candidates[:0]
        )
        keep = torch.cat([must.nonzero().squeeze(1), top])
        return state.candidates[keep.sort().values]

    def static_selection(self, plan: FusionPlan, num_layers: int) -> StaticSelection | None:
        if self.signal == "kv":
            return None  # normalised by the candidates' mean norms: not worth a static form yet
        checks, kept = [], plan.num_cached
        for layer, multiple in self.schedule:
            if layer >= num_layers - 1:
                return None
            budget = share_budget(self._share(layer, multiple), plan)
            if budget < kept:  # (select() keeps every candidate otherwise)
                checks.append((layer, budget))
                kept = budget
        return DeviationNarrowing(self.layer0_positions(plan), tuple(checks), self.signal)


for _method in (CacheBlend, CacheBlendHKVD):
    register_method(_method)
