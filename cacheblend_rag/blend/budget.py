"""How many cached tokens query-aware CacheBlend recomputes for one request: its budget.

A budget is a typed value carrying only its own options: :class:`FixedBudget` (the ``ratio`` share),
:class:`CoverBudget` (the fewest tokens that cover ``target`` of the question's attention) or
:class:`MarginBudget` (``ratio`` where the next token could flip, ``min_ratio`` where it is sure). A method
spec names one flat, as it always has (``budget=auto,target=0.7``): :func:`fold_flat_budget` is the one
place that turns that spelling into the typed value, and :data:`FLAT_SPELLING` turns it back for labels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
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


Budget = Annotated[FixedBudget | CoverBudget | MarginBudget, Field(discriminator="kind")]

# The flat spec spelling of each budget kind ('auto' is the cover budget's older name, kept in labels so
# that results recorded under it resume), and the options a flat spec may name beside ``budget``.
FLAT_SPELLING: dict[str, str] = {"fixed": "fixed", "cover": "auto", "margin": "margin"}
_KINDS = {"fixed": "fixed", "auto": "cover", "cover": "cover", "margin": "margin"}
FLAT_OPTIONS: tuple[str, ...] = ("target", "min_ratio", "confident")
BUDGET_HELP = (
    "how many cached tokens: 'fixed' the ratio share; 'auto' (or 'cover': target, min_ratio) the fewest "
    "covering target of the question's attention, within min_ratio and ratio; 'margin' (min_ratio, "
    "confident) ratio where the next token over the cached chunks could flip, else min_ratio"
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
        raise ValueError(f"no budget {kind!r}: 'fixed', 'auto' (or 'cover') or 'margin'")
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
