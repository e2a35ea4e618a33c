"""Position-independent caching (PIC) methods: which tokens does the fusor recompute at each layer?

A method answers two questions: which positions are computed at layer 0, and, at the layers it declares
as check layers, which of the positions computed so far continue. Everything a method does not select
keeps its cached KV. Tokens outside cached chunks (template, separators, question) and the last prompt
token are always computed, whatever the method.

A method owns itself: its options are typed, validated and bounded fields of its class (a pydantic
model, so adding an option is one line), it declares what KV it reuses (:class:`Reuse`) and which option,
if any, the loading controller may choose. Callers name a method with a :class:`MethodSpec`
(``cacheblend``, ``cacheblend@0.15``, ``cacheblend@ratio=0.15,signal=v``) and turn a request into a
method with :func:`~.spec.resolve_method` (both in :mod:`.spec`); nothing outside this package looks
at a method's name.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from importlib.metadata import entry_points
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..config import DEFAULT_RATIO
from ..errors import MethodOptionError
from .plan import FusionPlan, LayerState
from .static_layout import DeviationNarrowing, HostRows, QueryTopK, StaticSelection

# What a method label computes changes when a default option does: results recorded under one revision are
# not resumed under another (eval's results files). 2: cacheblend's chunk-shift correction on by default.
METHODS_REVISION = 2


class Reuse(StrEnum):
    """What KV a method reuses, which decides how a request's segments are built for it."""

    NOTHING = "nothing"  # no KV is loaded: every token is computed
    PREFIX = "prefix"  # the KV of the prompt's own prefix, cached under exactly those token ids
    CHUNKS = "chunks"  # each chunk's KV, precomputed alone at positions 0..n-1


class RoundSharing(StrEnum):
    """Whether requests that read the same chunks may share one blend of them (:mod:`.round`)."""

    NONE = "none"  # each request fused alone (the method reuses no chunk KV, or must stay exact)
    SAME_PREFIX = "same_prefix"  # only requests whose text up to their last chunk is the round's own
    # only requests whose chunks come in the same order (any text of their own before, between or after):
    # a blend that moved every token of a chunk by what the passages before it changed (blend/shift.py)
    # is wrong for a request that has other passages before that chunk
    SAME_ORDER = "same_order"
    ANY = "any"  # every request over the same chunks, whatever its own text before, between or after


class RecomputeMethod(BaseModel, ABC):
    """The PIC-method interface the fusor applies. Subclass it, declare options as fields and
    :func:`register_method` the class to add one (see :class:`CacheBlend` for an example)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: ClassVar[str]
    reuses: ClassVar[Reuse] = Reuse.CHUNKS
    shorthand: ClassVar[str | None] = None  # the option ``name@value`` sets
    ratio_option: ClassVar[str | None] = None  # the option the loading controller chooses when not given

    def __init__(self, **options: Any) -> None:
        try:
            super().__init__(**options)
        except ValidationError as exc:
            raise _option_error(type(self), exc) from None

    @abstractmethod
    def layer0_positions(self, plan: FusionPlan) -> torch.Tensor:
        """Positions computed at layer 0 (ascending; must include every ``plan.must_compute`` position)."""

    def check_layers(self, plan: FusionPlan) -> tuple[int, ...]:
        """Layers at which :meth:`select` narrows the recomputed set; none by default."""
        return ()

    def select(self, state: LayerState) -> torch.Tensor:
        """Positions, a subset of ``state.candidates`` (with all must-compute ones), that go on."""
        return state.candidates

    def round_sharing(self) -> RoundSharing:
        """How requests fused with this method may share a round's blend of their common chunks
        (default: any request that reuses chunk KV may)."""
        return RoundSharing.ANY if self.reuses is Reuse.CHUNKS else RoundSharing.NONE

    def uses_query_attention(self, plan: FusionPlan) -> bool:
        """Whether the fusor should run the query probe first (blend/probe.py) and set
        ``plan.query_attention`` before :meth:`layer0_positions`; no by default."""
        return False

    def probe_layers(self, num_layers: int) -> int:
        """How many of the model's layers (the first ones) the query probe runs and scores; all by
        default."""
        return num_layers

    def probe_logits(self) -> bool:
        """Whether the query probe should also finish its last layer and set ``plan.probe_logits`` (the
        next token's logits over the cached chunks as they are) before :meth:`layer0_positions`; no by
        default."""
        return False

    def shifts_chunks(self) -> bool:
        """Whether the fusor should correct each chunk's kept cached K/V by the mean change its recomputed
        tokens show at the same layer (blend/shift.py); no by default."""
        return False

    def static_selection(self, plan: FusionPlan, num_layers: int) -> StaticSelection | None:
        """What the method recomputes, in a form the host knows before the fusion runs (the static
        fusion of an accelerator, blend/static.py), or None when that needs values only the fusion finds.
        Default: the layer-0 positions of a method with no probe and no check layers."""
        if self.uses_query_attention(plan) or self.check_layers(plan) or self.probe_logits():
            return None
        return HostRows(self.layer0_positions(plan))

    def describe(self) -> dict[str, Any]:
        """The method and its options, JSON-able (what results report as ``method_options``)."""
        return {"method": self.name, **self.options()}

    def options(self) -> dict[str, Any]:
        """The option values, JSON-able."""
        return {name: jsonable(getattr(self, name)) for name in type(self).model_fields}


def _all_positions(plan: FusionPlan) -> torch.Tensor:
    return torch.arange(plan.num_tokens)


class FullRecompute(RecomputeMethod):
    """Every token at every layer: the quality reference, equal to full prefill."""

    name = "full_recompute"
    reuses = Reuse.NOTHING

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
    reuses = Reuse.PREFIX

    def layer0_positions(self, plan: FusionPlan) -> torch.Tensor:
        keep = plan.must_compute.clone()
        first = plan.segments[0]
        reused_end = plan.spans[0][1] if first.is_cached else 0
        keep[reused_end:] = True
        return keep.nonzero().squeeze(1)


class Epic(RecomputeMethod):
    """EPIC's attention-sink fix: recompute the first ``k`` tokens of every cached chunk, plus fresh text."""

    name = "epic"
    shorthand = "k"

    k: int = Field(16, ge=0, le=1 << 20, description="tokens recomputed at the start of every chunk")

    def layer0_positions(self, plan: FusionPlan) -> torch.Tensor:
        keep = plan.must_compute.clone()
        for start, end in plan.chunk_spans():
            keep[start : min(end, start + self.k)] = True
        return keep.nonzero().squeeze(1)


# Check layers and the share of cached tokens kept at each, as multiples of the final ratio r (the last
# entry is r itself), for HKVD selection. See docs/fusor.md.
DEFAULT_SCHEDULE: tuple[tuple[int, float], ...] = ((1, 1.0),)


class CacheBlend(RecomputeMethod):
    """CacheBlend: reuse every cached chunk's KV except the ``ratio`` share of cached tokens that matter
    most, which are recomputed at every layer (fresh text is always computed).

    Which tokens matter is the ``selection`` rule:

    - ``query`` (default): the tokens the question attends to most. A probe pass computes only the fresh
      text over the cached KV and records where the question's tokens look, summed over layers and heads
      (blend/probe.py); the top ``ratio`` of cached tokens are then recomputed from layer 0.
    - ``hkvd``: the paper's rule. Layer 0 computes every token; at each check layer of ``schedule`` the
      cached tokens whose fresh K (or V, ``signal``) deviates most from the cached one are kept.

    With ``shift`` (default on) every chunk's kept K/V then move, at each layer, by the mean change its
    recomputed tokens show there (blend/shift.py): the recomputed tokens measure what the chunk missed by
    being precomputed alone, for all of it.
    """

    name = "cacheblend"
    shorthand = "ratio"
    ratio_option = "ratio"

    ratio: float = Field(
        DEFAULT_RATIO, ge=0.0, le=1.0, description="share of cached tokens recomputed, in [0, 1]"
    )
    selection: Literal["query", "hkvd"] = Field(
        "query", description="which cached tokens to recompute: 'query' (question attention) or 'hkvd'"
    )
    score: Literal["attention", "contribution"] = Field(
        "contribution",
        description="query only: rank by the attention the question pays a token, or by that attention "
        "times the token's value norm (its contribution to the attention output)",
    )
    budget: Literal["fixed", "auto", "margin"] = Field(
        "fixed",
        description="query only: 'fixed' recomputes the ratio share of cached tokens; 'auto' the fewest "
        "tokens whose contribution covers 'target' of the question's attention to the cached tokens, "
        "between min_ratio and ratio of them; 'margin' ratio where the next token over the cached "
        "chunks as they are could flip (see 'confident'), min_ratio where it is sure",
    )
    target: float = Field(
        0.5, gt=0.0, le=1.0, description="budget=auto: share of the question's attention to cover"
    )
    min_ratio: float = Field(
        0.02, ge=0.0, le=1.0, description="budget=auto/margin: fewest cached tokens recomputed, as a share"
    )
    confident: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="budget=margin: the lead of full reuse's next token (its probability minus the "
        "second's, from the probe) under which ratio is recomputed; at or above it, min_ratio",
    )
    probe_depth: int = Field(
        0,
        ge=0,
        le=4096,
        description="query only: score the question's attention over the first N layers only (a cheaper "
        "probe, a different selection); 0 (default) scores every layer",
    )
    shift: bool = Field(
        True,
        description="correct every chunk's kept cached K/V by the mean change its recomputed tokens show "
        "at the same layer (keys in their unrotated frame): the chunk-shift correction; false: off",
    )
    chunk_rows: int = Field(
        0,
        ge=0,
        le=4096,
        description="query with shift only: each chunk's best N tokens by the question's reading are "
        "recomputed first, out of the same budget, so that every chunk has rows to measure its shift by; "
        "0 (default): the budget's best tokens wherever they are",
    )
    signal: Literal["k", "v", "kv"] = Field(
        "k", description="hkvd only: deviation of K, V or both (each normalised)"
    )
    schedule: tuple[tuple[int, float], ...] = Field(
        DEFAULT_SCHEDULE,
        description="hkvd only: check layers and their share as multiples of ratio: [[layer, x], ...]",
    )

    @model_validator(mode="after")
    def _check_schedule(self) -> CacheBlend:
        layers = [layer for layer, _ in self.schedule]
        if not layers or layers != sorted(set(layers)):
            raise ValueError("schedule needs at least one check layer, in increasing layer order")
        if layers[0] < 1:
            raise ValueError("the first check layer must be >= 1 (layer 0 is always computed in full)")
        if self.budget == "margin" and (self.selection != "query" or self.probe_depth):
            raise ValueError(
                "budget='margin' needs selection='query' and a probe of every layer (probe_depth 0)"
            )
        return self

    def uses_query_attention(self, plan: FusionPlan) -> bool:
        return self.selection == "query"

    def probe_layers(self, num_layers: int) -> int:
        return min(self.probe_depth, num_layers) if self.probe_depth else num_layers

    def probe_logits(self) -> bool:
        return self.budget == "margin"

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

    def layer0_positions(self, plan: FusionPlan) -> torch.Tensor:
        if self.selection == "hkvd":
            return (~plan.exact_mask).nonzero().squeeze(1)
        keep = plan.must_compute.clone()
        cached = plan.candidate_mask.nonzero().squeeze(1)
        budget = min(share_budget(self.ratio, plan), cached.numel())
        score = plan.query_attention if self.score == "attention" else plan.query_contribution
        if budget and score is not None:
            ranked = torch.sort(score[cached], descending=True)
            if self.budget == "auto":
                budget = self._covering(ranked.values, budget, plan)
            elif self.budget == "margin" and plan.probe_logits is not None:
                budget = min(budget, share_budget(self.margin_share(plan.probe_logits), plan))
            floor = self._chunk_floor(score, budget, plan) if self.shift and self.chunk_rows else None
            if floor is None:
                keep[cached[ranked.indices[:budget]]] = True
            else:  # the floor first, then the best of the rest up to the budget
                keep[floor] = True
                rest = ranked.indices[~keep[cached[ranked.indices]]]
                keep[cached[rest[: budget - floor.numel()]]] = True
        elif budget:  # no probe ran (nothing cached to look at): every candidate is recomputed
            keep[cached] = True
        return keep.nonzero().squeeze(1)

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

    def margin_share(self, logits: torch.Tensor) -> float:
        """budget=margin: the share of cached tokens to recompute when the cached chunks as they are give
        the next token ``logits``: ``ratio`` when its top probability leads the second by less than
        ``confident`` (an answer that could flip gets the budget), else ``min_ratio`` (one that will not,
        little). A step, so each request gets exactly what a fixed ratio of either value would give."""
        sure = next_token_lead(logits) >= self.confident
        return min(self.min_ratio, self.ratio) if sure else self.ratio

    def _covering(self, ranked: torch.Tensor, most: int, plan: FusionPlan) -> int:
        """budget=auto: how many of the best-ranked cached tokens cover ``target`` of the question's
        attention to all of them, within min_ratio and ``most`` (ratio's budget)."""
        least = min(most, math.floor(self.min_ratio * plan.num_cached + 1e-9))
        return max(least, min(most, tokens_covering(ranked, self.target)))

    def static_selection(self, plan: FusionPlan, num_layers: int) -> StaticSelection | None:
        if self.selection == "query":
            if self.budget != "fixed" or self.chunk_rows:
                return None  # sizes read from the probe's scores or spread by chunk
            budget = min(share_budget(self.ratio, plan), plan.num_cached)
            if budget == 0:
                return HostRows(plan.must_compute.nonzero().squeeze(1))
            if budget == plan.num_cached:  # every candidate: no probe needed to choose among them
                return HostRows((plan.must_compute | plan.candidate_mask).nonzero().squeeze(1))
            return QueryTopK(budget, self.score, self.probe_layers(num_layers))
        if self.signal == "kv":
            return None  # normalised by the candidates' mean norms: not worth a static form yet
        checks, kept = [], plan.num_cached
        for layer, multiple in self.schedule:
            if layer >= num_layers - 1:
                return None
            share = self.ratio if layer == self.schedule[-1][0] else min(1.0, self.ratio * multiple)
            budget = share_budget(share, plan)
            if budget < kept:  # (select() keeps every candidate otherwise)
                checks.append((layer, budget))
                kept = budget
        return DeviationNarrowing(self.layer0_positions(plan), tuple(checks), self.signal)

    def check_layers(self, plan: FusionPlan) -> tuple[int, ...]:
        if self.selection == "query":
            return ()
        return tuple(layer for layer, _ in self.schedule)

    def select(self, state: LayerState) -> torch.Tensor:
        multiple = dict(self.schedule)[state.layer]
        is_last = state.layer == self.schedule[-1][0]
        share = self.ratio if is_last else min(1.0, self.ratio * multiple)
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


def next_token_lead(logits: torch.Tensor) -> float:
    """How sure a next-token distribution is: its top probability minus the runner-up's, from logits or
    log-probabilities ([V])."""
    top = torch.softmax(logits.float(), dim=-1).topk(2).values
    return float(top[0] - top[1])


def share_budget(share: float, plan: FusionPlan) -> int:
    """Cached tokens a share of them amounts to: rounded down, so a ratio r never recomputes more than r of
    the cached tokens, yet at least one for any share > 0."""
    if share <= 0:
        return 0
    return max(1, math.floor(share * plan.num_cached + 1e-9))


def tokens_covering(ranked: torch.Tensor, target: float) -> int:
    """How many of the first scores of ``ranked`` (non-negative, best first) sum to at least ``target`` of
    their total; 0 when they are all zero."""
    total = float(ranked.sum())
    if total <= 0:
        return 0
    covered = torch.cumsum(ranked, 0) / total
    first_covering = int(torch.searchsorted(covered, torch.tensor(target, dtype=covered.dtype)))
    return min(ranked.numel(), first_covering + 1)


# -- the registry ------------------------------------------------------------------------------------

MethodFactory = Callable[..., RecomputeMethod]


@dataclass(frozen=True)
class _Entry:
    factory: MethodFactory
    cls: type[RecomputeMethod]


_REGISTRY: dict[str, _Entry] = {}
# Methods other packages declare in this entry point group (``name = "package.module:MethodClass"``) are
# registered the first time a name is looked up that is not registered yet, or the methods are listed.
ENTRY_POINT_GROUP = "cacheblend_rag.methods"
_plugins_loaded = False


def register_method(method: type[RecomputeMethod] | str, factory: MethodFactory | None = None):
    """Make a method available by name to the engines, CLI, integrations and eval.

    ``register_method(MyMethod)`` (also usable as a class decorator) registers a class under its
    ``name``; its fields are its options. ``register_method(name, factory)`` registers a callable that
    takes the options as keywords; it must also work without any, returning the method with its
    defaults (which tells the registry the method's class)."""
    if isinstance(method, type) and issubclass(method, RecomputeMethod):
        _REGISTRY[method.name] = _Entry(method, method)
        return method
    if not isinstance(method, str) or factory is None:
        raise TypeError("register_method takes a RecomputeMethod subclass, or a name and a factory")
    _REGISTRY[method] = _Entry(factory, type(factory()))
    return factory


def available_methods() -> list[str]:
    _load_plugins()
    return sorted(_REGISTRY)


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        method = entry_point.load()
        if not (isinstance(method, type) and issubclass(method, RecomputeMethod)):
            raise TypeError(
                f"entry point {entry_point.name} = {entry_point.value} of {ENTRY_POINT_GROUP} is not a "
                "RecomputeMethod subclass"
            )
        _REGISTRY.setdefault(method.name, _Entry(method, method))


def method_class(name: str) -> type[RecomputeMethod]:
    """The class of the method registered as ``name``; an unknown name raises, listing the known ones."""
    return _entry(name).cls


def get_method(name: str, **options: Any) -> RecomputeMethod:
    """Instantiate a registered method, e.g. ``get_method("cacheblend", ratio=0.2)``. Unknown or invalid
    options raise :class:`MethodOptionError`, naming the method and its options."""
    entry = _entry(name)
    unknown = sorted(set(options) - set(entry.cls.model_fields))
    if unknown:
        raise MethodOptionError(
            f"method {name!r} has no option {', '.join(map(repr, unknown))}; {options_help(entry.cls)}"
        )
    return entry.factory(**options)


def _entry(name: str) -> _Entry:
    if isinstance(name, str) and name not in _REGISTRY:
        _load_plugins()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise MethodOptionError(
            f"unknown method {name!r}; available: {', '.join(available_methods())}"
        ) from None


def options_help(cls: type[RecomputeMethod], about: Sequence[str] = ()) -> str:
    """The method's options for an error message: the ``about`` ones described (an option given a bad
    value: what it means and its default), else every option's name and default. Short on purpose: every
    option's whole description is a screenful, which hid the one line that mattered."""
    fields = cls.model_fields
    if not fields:
        return "it takes no options"
    if about:
        return "; ".join(
            f"about {name}: {fields[name].description} (default {json.dumps(jsonable(fields[name].default))})"
            for name in about
        )
    return "its options: " + ", ".join(
        f"{name} (default {json.dumps(jsonable(f.default))})" for name, f in fields.items()
    )


def _option_error(cls: type[RecomputeMethod], exc: ValidationError) -> MethodOptionError:
    problems, about = [], []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "options"
        if error["type"] == "extra_forbidden":
            problems.append(f"no option {where!r}")
        else:
            problems.append(f"{where}: {error['msg']} (got {error['input']!r})")
            if where in cls.model_fields and where not in about:
                about.append(where)
    # an unknown option lists the method's options; a bad value explains only the options it concerns
    unknown = len(about) < len(problems)
    return MethodOptionError(
        f"method {cls.name!r}: {'; '.join(problems)}; {options_help(cls, () if unknown else about)}"
    )


def jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [jsonable(v) for v in value]
    return value


for _method in (FullRecompute, FullReuse, PrefixCache, Epic, CacheBlend):
    register_method(_method)
