"""Position-independent caching (PIC) methods: which tokens does the fusor recompute at each layer?

A method answers two questions: which positions are computed at layer 0, and, at the layers it declares
as check layers, which of the positions computed so far continue. Everything a method does not select
keeps its cached KV. Tokens outside cached chunks (template, separators, question) and the last prompt
token are always computed, whatever the method.

A method owns itself: its options are typed, validated and bounded fields of its class (a pydantic
model, so adding an option is one line), it declares what KV it reuses (:class:`Reuse`) and which option,
if any, the loading controller may choose. Callers name a method with a :class:`MethodSpec`
(``cacheblend``, ``cacheblend@0.15``, ``cacheblend_hkvd@ratio=0.15,signal=v``) and turn a request
into a method with :func:`~.spec.resolve_method` (both in :mod:`.spec`); nothing outside this package
looks at a method's name. This module holds the interface, the simple methods and the registry;
CacheBlend's two methods and their budgets are in :mod:`.cacheblend` and :mod:`.budget`.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from importlib.metadata import entry_points
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import MethodOptionError
from .budget_choice import BudgetChoice
from .plan import FusionPlan, LayerState
from .static_layout import HostRows, StaticSelection

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
    :func:`register_method` the class to add one (see :class:`Epic` or :mod:`.cacheblend` for
    examples)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: ClassVar[str]
    reuses: ClassVar[Reuse] = Reuse.CHUNKS
    shorthand: ClassVar[str | None] = None  # the option ``name@value`` sets
    ratio_option: ClassVar[str | None] = None  # the option the loading controller chooses when not given
    # options a spec may name besides the fields: older spellings a validator folds into a field
    spelled_options: ClassVar[frozenset[str]] = frozenset()
    # options of another method (option -> that method's name), refused with a pointer to it
    options_elsewhere: ClassVar[Mapping[str, str]] = {}

    def __init__(self, **options: Any) -> None:
        try:
            super().__init__(**options)
        except ValidationError as exc:
            raise _option_error(type(self), exc) from None

    @classmethod
    def option_names(cls) -> frozenset[str]:
        """Every option a spec or :func:`get_method` may name for this method."""
        return frozenset(cls.model_fields) | cls.spelled_options

    @classmethod
    def respelled(cls, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """The registered method name and options that ``options`` given to this method are an older
        spelling of (another method's, or fewer options), or None where they are its own."""
        return None

    def spec_options(self, given: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
        """The options a spec ``given`` (as parsed) names, with their checked values, as its label shows
        them."""
        return tuple((key, getattr(self, key)) for key in given)

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

    def request_choice(self, chunk_lengths: Sequence[int]) -> BudgetChoice | None:
        """What the method chose for one request whose blended chunks hold ``chunk_lengths`` tokens
        (results report it as ``budget``), or None when it chooses nothing per request."""
        return None

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
    name, options = canonical_options(name, options)
    entry = _entry(name)
    unknown = sorted(set(options) - entry.cls.option_names())
    if unknown:
        where = _elsewhere(entry.cls, {key: options[key] for key in unknown})
        raise MethodOptionError(
            f"method {name!r} has no option {', '.join(map(repr, unknown))}{where}; {options_help(entry.cls)}"
        )
    return entry.factory(**options)


def canonical_options(name: str, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The method name and options that ``name`` with ``options`` stand for, an older spelling respelled
    (``cacheblend`` with ``selection="hkvd"`` is ``cacheblend_hkvd``, with a deprecation warning)."""
    respelled = _entry(name).cls.respelled(options)
    return respelled if respelled is not None else (name, dict(options))


def _elsewhere(cls: type[RecomputeMethod], options: Mapping[str, Any]) -> str:
    """Where options this method does not take belong, for its error message ('' when nowhere known)."""
    hints = [
        f"{key!r} is an option of {cls.options_elsewhere[key]!r}: "
        f"name that method, e.g. {cls.options_elsewhere[key]}@{key}={_spelled(value)}"
        for key, value in options.items()
        if key in cls.options_elsewhere
    ]
    return f" ({'; '.join(hints)})" if hints else ""


def _spelled(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(jsonable(value), separators=(",", ":"))


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
        loc = [str(part) for part in error["loc"]]
        # an option that is itself typed (a budget): its field, its kind, then the kind's own option
        typed = len(loc) == 3 and isinstance(error["loc"][1], str)
        field, inner = (loc[0], f"{loc[0]} {loc[1]!r} ") if typed else (".".join(loc), "")
        if error["type"] == "extra_forbidden" and inner:
            problems.append(f"{inner}has no option {loc[2]!r}")
        elif error["type"] == "extra_forbidden":
            problems.append(f"no option {field!r}{_elsewhere(cls, {field: error['input']})}")
            continue
        elif inner:
            problems.append(f"{inner}{loc[2]}: {error['msg']} (got {error['input']!r})")
        elif not loc:  # the whole model's check: its message says what is wrong
            problems.append(error["msg"].removeprefix("Value error, "))
            continue
        else:
            problems.append(f"{field}: {error['msg']} (got {error['input']!r})")
        if field in cls.model_fields and field not in about:
            about.append(field)
    # an unknown option lists the method's options; a bad value explains only the options it concerns
    unknown = len(about) < len(problems)
    return MethodOptionError(
        f"method {cls.name!r}: {'; '.join(problems)}; {options_help(cls, () if unknown else about)}"
    )


def jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, BaseModel):  # a typed option (a budget): a small dict
        return value.model_dump()
    return value


for _method in (FullRecompute, FullReuse, PrefixCache, Epic):
    register_method(_method)
