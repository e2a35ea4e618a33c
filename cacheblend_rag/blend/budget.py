"""How many cached tokens query-aware CacheBlend recomputes for one request: its budget.

A budget is a typed value carrying only its own options: :class:`FixedBudget` (the ``ratio`` share),
:class:`CoverBudget` (the fewest tokens that cover ``target`` of the question's attention),
:class:`MarginBudget` (``ratio`` where the next token could flip, ``min_ratio`` where it is sure) or
:class:`AdaptiveBudget` (by the chunks' length: the fixed share for long chunks, a cover budget for short
ones, where it does better at equal compute; the default's). A method
spec names one flat, as it always has (``budget=auto,target=0.7``): :func:`fold_flat_budget` is the one
place that turns that spelling into the typed value, and :data:`FLAT_SPELLING` turns it back for labels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from .methods import next_token_lead, share_budget
from .plan import FusionPlan

_MIN_RATIO = Field(0.02, ge=0.0, le=1.0, description="fewest cached tokens recomputed, as a share")


class _Budget(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str

    def tokens(self, most: int, ranked: torch.Tensor, ratio: float, plan: FusionPlan) -> int:
        """How many of the cached tokens, ranked best first by ``ranked`` (their scores), to recompute;
        ``most`` is the ``ratio`` share of them."""
        raise NotImplementedError


class FixedBudget(_Budget):
    """The method's ``ratio`` share of the cached tokens, whatever the request."""

    kind: Literal["fixed"] = "fixed"

    def tokens(self, most: int, ranked: torch.Tensor, ratio: float, plan: FusionPlan) -> int:
        return most


class CoverBudget(_Budget):
    """The fewest best-ranked cached tokens whose scores cover ``target`` of the question's attention to
    all of them, at least ``min_ratio`` and at most ``ratio`` of them."""

    kind: Literal["cover"] = "cover"
    target: float = Field(0.5, gt=0.0, le=1.0, description="share of the question's attention to cover")
    min_ratio: float = _MIN_RATIO

    def tokens(self, most: int, ranked: torch.Tensor, ratio: float, plan: FusionPlan) -> int:
        least = min(most, math.floor(self.min_ratio * plan.num_cached + 1e-9))
        return max(least, min(most, tokens_covering(ranked, self.target)))


class MarginBudget(_Budget):
    """``ratio`` of the cached tokens where full reuse's next token (from the probe's logits) leads the
    runner-up by less than ``confident`` (an answer that could flip), else ``min_ratio`` of them."""

    kind: Literal["margin"] = "margin"
    min_ratio: float = _MIN_RATIO
    confident: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="the lead of full reuse's next token (its probability minus the second's) under "
        "which ratio is recomputed; at or above it, min_ratio",
    )

    def share(self, ratio: float, logits: torch.Tensor) -> float:
        """The share of cached tokens to recompute when the cached chunks as they are give the next token
        ``logits``. A step, so each request gets exactly what a fixed ratio of either value would give."""
        sure = next_token_lead(logits) >= self.confident
        return min(self.min_ratio, ratio) if sure else ratio

    def tokens(self, most: int, ranked: torch.Tensor, ratio: float, plan: FusionPlan) -> int:
        if plan.probe_logits is None:  # a round's shared blend reads no logits: ratio's budget
            return most
        return min(most, share_budget(self.share(ratio, plan.probe_logits), plan))


class AdaptiveBudget(_Budget):
    """Chosen per request by the blended chunks' length. Chunks averaging more than ``short_tokens``
    get the method's ``ratio`` share; shorter ones, with more chunk boundaries per cached token (each a
    place where a chunk prefilled apart missed what came before it), get ``short_extra`` more of them
    (at most all): a fixed share, or with ``target`` the cover budget within it (the fewest best-ranked
    tokens covering ``target`` of the question's attention, at least ``min_ratio``). The share grows
    with the ratio asked (the loading controller's, a sweep's), and a ratio of 0 recomputes none."""

    kind: Literal["adaptive"] = "adaptive"
    short_tokens: int = Field(
        150, ge=0, description="mean blended-chunk length (tokens) at or under which chunks count as short"
    )
    short_extra: float = Field(
        0.1, ge=0.0, le=1.0, description="short chunks: this share more than the ratio is recomputed"
    )
    target: float | None = Field(
        None, gt=0.0, le=1.0, description="short chunks: cover this share of the attention (None: fixed)"
    )
    min_ratio: float = _MIN_RATIO

    def is_short(self, chunk_lengths: Sequence[int]) -> bool:
        """Whether chunks of ``chunk_lengths`` tokens count as short (none blended: not)."""
        return bool(chunk_lengths) and sum(chunk_lengths) <= self.short_tokens * len(chunk_lengths)

    def choose(self, chunk_lengths: Sequence[int], ratio: float) -> tuple[FixedBudget | CoverBudget, float]:
        """The budget a request whose blended chunks hold ``chunk_lengths`` tokens gets, and the share of
        its cached tokens that budget is bounded by (``ratio``: the method's)."""
        if not self.is_short(chunk_lengths):
            return FixedBudget(), ratio
        share = min(1.0, ratio + self.short_extra) if ratio > 0 else 0.0
        if self.target is None:
            return FixedBudget(), share
        return CoverBudget(target=self.target, min_ratio=self.min_ratio), share

    def for_plan(self, plan: FusionPlan, ratio: float) -> tuple[FixedBudget | CoverBudget, float]:
        return self.choose([end - start for start, end in plan.chunk_spans()], ratio)

    def tokens(self, most: int, ranked: torch.Tensor, ratio: float, plan: FusionPlan) -> int:
        chosen, share = self.for_plan(plan, ratio)  # (``most`` is this at share == ratio)
        return chosen.tokens(min(share_budget(share, plan), ranked.numel()), ranked, share, plan)


Budget = Annotated[FixedBudget | CoverBudget | MarginBudget | AdaptiveBudget, Field(discriminator="kind")]


def request_budget(budget: _Budget, plan: FusionPlan, ratio: float) -> tuple[_Budget, float]:
    """The budget one request gets and the share of its cached tokens bounding it: an adaptive budget's
    choice for its chunks, any other budget as it is with ``ratio``."""
    return budget.for_plan(plan, ratio) if isinstance(budget, AdaptiveBudget) else (budget, ratio)


# The flat spec spelling of each budget kind ('auto' is the cover budget's older name, kept in labels so
# that results recorded under it resume), and the options a flat spec may name beside ``budget``.
FLAT_SPELLING: dict[str, str] = {
    "fixed": "fixed",
    "cover": "auto",
    "margin": "margin",
    "adaptive": "adaptive",
}
_KINDS = {"fixed": "fixed", "auto": "cover", "cover": "cover", "margin": "margin", "adaptive": "adaptive"}
FLAT_OPTIONS: tuple[str, ...] = ("target", "min_ratio", "confident", "short_tokens", "short_extra")
BUDGET_HELP = (
    "how many cached tokens: 'fixed' the ratio share; 'auto' (or 'cover': target, min_ratio) the fewest "
    "covering target of the question's attention, within min_ratio and ratio; 'margin' (min_ratio, "
    "confident) ratio where the next token over the cached chunks could flip, else min_ratio; "
    "'adaptive' (short_tokens, short_extra, target, min_ratio) the ratio share for chunks averaging over "
    "short_tokens, short_extra more for shorter ones (with target: the cover budget within that)"
)


def fold_flat_budget(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with a budget's options named flat (``budget="auto", target=0.7``, as a spec names
    them) folded into the one ``budget`` value; a flat option without ``budget`` goes to the fixed
    budget, which refuses it by name."""
    flat = {key: options[key] for key in FLAT_OPTIONS if key in options}
    if not flat:
        return dict(options)
    budget = options.get("budget", "fixed")
    if isinstance(budget, str):
        base: dict[str, Any] = {"kind": budget}
    elif isinstance(budget, Mapping):
        base = dict(budget)
    elif isinstance(budget, _Budget):
        base = {"kind": budget.kind, **budget.model_dump(exclude_unset=True)}
    else:
        return dict(options)  # not a budget at all: the field's validation names it
    rest = {key: value for key, value in options.items() if key not in FLAT_OPTIONS}
    return {**rest, "budget": {**base, **flat}}


def spelled_budget(value: Any) -> Any:
    """A budget given by its kind's name (``"auto"``) or as a mapping, with the kind's canonical name;
    an unknown kind is refused here, by name."""
    kind = value if isinstance(value, str) else value.get("kind") if isinstance(value, Mapping) else None
    if not isinstance(kind, str):
        return value
    if kind not in _KINDS:
        raise ValueError(f"no budget {kind!r}: 'fixed', 'auto' (or 'cover'), 'margin' or 'adaptive'")
    return {**(value if isinstance(value, Mapping) else {}), "kind": _KINDS[kind]}


def tokens_covering(ranked: torch.Tensor, target: float) -> int:
    """How many of the first scores of ``ranked`` (non-negative, best first) sum to at least ``target`` of
    their total; 0 when they are all zero."""
    total = float(ranked.sum())
    if total <= 0:
        return 0
    covered = torch.cumsum(ranked, 0) / total
    first_covering = int(torch.searchsorted(covered, torch.tensor(target, dtype=covered.dtype)))
    return min(ranked.numel(), first_covering + 1)
