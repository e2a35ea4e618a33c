"""Position-independent caching (PIC) methods: which tokens does the fusor recompute at each layer?

A method answers two questions: which positions are computed at layer 0, and, at the layers it declares
as check layers, which of the positions computed so far continue. Everything a method does not select
keeps its cached KV. Tokens outside cached chunks (template, separators, question) and the last prompt
token are always computed, whatever the method.

A method owns itself: its options are typed, validated and bounded fields of its class (a pydantic
model, so adding an option is one line), it declares what KV it reuses (:class:`Reuse`) and which option,
if any, the loading controller may choose. Callers name a method with a :class:`MethodSpec`
(``cacheblend``, ``cacheblend@0.15``, ``cacheblend@ratio=0.15,signal=v``) and turn a request into a
method with :func:`resolve_method`; nothing outside this package looks at a method's name.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import MethodOptionError
from .controller import Decision, LoadingController
from .plan import FusionPlan, LayerState
from .segments import Segment


class Reuse(StrEnum):
    """What KV a method reuses, which decides how a request's segments are built for it."""

    NOTHING = "nothing"  # no KV is loaded: every token is computed
    PREFIX = "prefix"  # the KV of the prompt's own prefix, cached under exactly those token ids
    CHUNKS = "chunks"  # each chunk's KV, precomputed alone at positions 0..n-1


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

    def describe(self) -> dict[str, Any]:
        """The method and its options, JSON-able (what results report as ``method_options``)."""
        return {"method": self.name, **self.options()}

    def options(self) -> dict[str, Any]:
        """The option values, JSON-able."""
        return {name: _jsonable(getattr(self, name)) for name in type(self).model_fields}


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
        for start, end in plan.cached_spans():
            keep[start : min(end, start + self.k)] = True
        return keep.nonzero().squeeze(1)


# Check layers and the share of cached tokens kept at each, as multiples of the final ratio r (the last
# entry is r itself). Chosen by measurement; see docs/fusor.md.
DEFAULT_SCHEDULE: tuple[tuple[int, float], ...] = ((1, 1.0),)


class CacheBlend(RecomputeMethod):
    """CacheBlend: layer 0 computes every token; at each check layer the cached candidates with the
    highest KV deviation (HKVD) are kept, narrowing gradually to ``ratio`` of the cached tokens, which
    are recomputed at every later layer."""

    name = "cacheblend"
    shorthand = "ratio"
    ratio_option = "ratio"

    ratio: float = Field(0.15, ge=0.0, le=1.0, description="share of cached tokens recomputed, in [0, 1]")
    signal: Literal["k", "v", "kv"] = Field("k", description="deviation of K, V or both (each normalised)")
    schedule: tuple[tuple[int, float], ...] = Field(
        DEFAULT_SCHEDULE, description="check layers and their share as multiples of ratio: [[layer, x], ...]"
    )

    @model_validator(mode="after")
    def _check_schedule(self) -> CacheBlend:
        layers = [layer for layer, _ in self.schedule]
        if not layers or layers != sorted(set(layers)):
            raise ValueError("schedule needs at least one check layer, in increasing layer order")
        if layers[0] < 1:
            raise ValueError("the first check layer must be >= 1 (layer 0 is always computed in full)")
        return self

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


# -- the registry ------------------------------------------------------------------------------------

MethodFactory = Callable[..., RecomputeMethod]


@dataclass(frozen=True)
class _Entry:
    factory: MethodFactory
    cls: type[RecomputeMethod]


_REGISTRY: dict[str, _Entry] = {}


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
    return sorted(_REGISTRY)


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
            f"method {name!r} has no option {', '.join(map(repr, unknown))}; {_options_help(entry.cls)}"
        )
    return entry.factory(**options)


def _entry(name: str) -> _Entry:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise MethodOptionError(
            f"unknown method {name!r}; available: {', '.join(available_methods())}"
        ) from None


def _options_help(cls: type[RecomputeMethod]) -> str:
    fields = cls.model_fields
    if not fields:
        return "it takes no options"
    described = [
        f"{name} (default {json.dumps(_jsonable(f.default))}: {f.description})" for name, f in fields.items()
    ]
    return "its options: " + "; ".join(described)


def _option_error(cls: type[RecomputeMethod], exc: ValidationError) -> MethodOptionError:
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "options"
        if error["type"] == "extra_forbidden":
            problems.append(f"no option {where!r}")
        else:
            problems.append(f"{where}: {error['msg']} (got {error['input']!r})")
    return MethodOptionError(f"method {cls.name!r}: {'; '.join(problems)}; {_options_help(cls)}")


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


for _method in (FullRecompute, FullReuse, PrefixCache, Epic, CacheBlend):
    register_method(_method)


# -- naming a method: specs --------------------------------------------------------------------------


@dataclass(frozen=True)
class MethodSpec:
    """A method name with options, labelled e.g. ``cacheblend@0.15`` (one column of eval results)."""

    label: str
    name: str
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        """``name``, ``name@value`` (the method's shorthand option: cacheblend@RATIO, epic@K) or
        ``name@option=value,option=value``. Values are checked by the method; the label is canonical."""
        name, at, body = text.strip().partition("@")
        method = method_class(name)
        if not at:
            return cls(name, name)
        if not body:
            raise MethodOptionError(f"{text!r}: nothing after '@'")
        parts = _split_options(body)
        if len(parts) == 1 and "=" not in parts[0]:
            if method.shorthand is None:
                raise MethodOptionError(
                    f"method {name!r} takes no @option (only methods with a shorthand option do, e.g. "
                    f"cacheblend@0.15); {_options_help(method)}"
                )
            given = {method.shorthand: parts[0]}
        else:
            given = {}
            for part in parts:
                key, eq, value = part.partition("=")
                if not eq or not key.strip():
                    raise MethodOptionError(f"{text!r}: expected option=value, got {part!r}")
                given[key.strip()] = value.strip()
        built = get_method(name, **{key: _parse_value(value) for key, value in given.items()})
        options = tuple((key, getattr(built, key)) for key in given)
        return cls(_label(method, options), name, options)

    def build(self) -> RecomputeMethod:
        return get_method(self.name, **dict(self.options))

    def with_ratio(self, ratio: float | None) -> MethodSpec:
        """This spec with its recompute ratio set to ``ratio``; unchanged when ``ratio`` is None or the
        method has no ratio (a ratio is a setting for the methods that take one, as ``--ratio`` is)."""
        option = self.method_class.ratio_option
        if ratio is None or option is None:
            return self
        options = {**dict(self.options), option: ratio}
        get_method(self.name, **options)  # refuses a ratio outside the method's bounds
        items = tuple(options.items())
        return MethodSpec(_label(self.method_class, items), self.name, items)

    @property
    def method_class(self) -> type[RecomputeMethod]:
        return method_class(self.name)

    @property
    def ratio(self) -> float | None:
        """The recompute ratio the spec sets, if its method has one."""
        option = self.method_class.ratio_option
        return dict(self.options).get(option) if option else None


def parse_method(text: str) -> MethodSpec:
    """:meth:`MethodSpec.parse`."""
    return MethodSpec.parse(text)


def reuse_of(method: str | MethodSpec | RecomputeMethod | Reuse) -> Reuse:
    """What KV ``method`` (a name, spec or instance; a :class:`Reuse` stands for itself) reuses."""
    if isinstance(method, Reuse):
        return method
    if isinstance(method, RecomputeMethod):
        return method.reuses
    spec = method if isinstance(method, MethodSpec) else MethodSpec.parse(method)
    return spec.method_class.reuses


def _split_options(body: str) -> list[str]:
    """Split on commas outside brackets (a value may be a JSON list)."""
    parts, depth, current = [], 0, []
    for char in body:
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts]


def _parse_value(text: str) -> Any:
    """A JSON value (number, list, true/false) or else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _label(method: type[RecomputeMethod], options: Sequence[tuple[str, Any]]) -> str:
    def show(value: Any) -> str:
        if isinstance(value, float | int) and not isinstance(value, bool):
            return f"{value:g}"
        return value if isinstance(value, str) else json.dumps(_jsonable(value), separators=(",", ":"))

    if not options:
        return method.name
    if len(options) == 1 and options[0][0] == method.shorthand:
        return f"{method.name}@{show(options[0][1])}"
    return f"{method.name}@" + ",".join(f"{key}={show(value)}" for key, value in options)


# -- resolving a request -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedMethod:
    """The method a request runs with, and the loading controller's decision when it chose an option."""

    method: RecomputeMethod
    decision: Decision | None = None

    @property
    def controller(self) -> dict[str, Any] | None:
        """The decision as results report it (None when the caller set every option)."""
        return self.decision.to_dict() if self.decision is not None else None


def resolve_method(
    method: str | MethodSpec | RecomputeMethod,
    segments: Sequence[Segment],
    controller: LoadingController | None = None,
    options: Mapping[str, Any] | None = None,
) -> ResolvedMethod:
    """The method a request over ``segments`` runs with.

    ``method`` is a registered name or spec with ``options`` (an option given as None counts as not
    given), or a ready instance (then ``options`` must be empty). When the method has a ratio option the
    caller left unset, ``controller`` chooses it from the cached tokens and the tier they load from."""
    options = {key: value for key, value in (options or {}).items() if value is not None}
    if isinstance(method, RecomputeMethod):
        if options:
            raise MethodOptionError(
                f"options {sorted(options)} were given with a ready {method.name!r} method; "
                "pass its name instead, or set them on the instance"
            )
        return ResolvedMethod(method)
    if isinstance(method, MethodSpec):
        method, options = method.name, {**dict(method.options), **options}
    elif "@" in method:
        spec = MethodSpec.parse(method)
        method, options = spec.name, {**dict(spec.options), **options}
    option = method_class(method).ratio_option
    decision = None
    if option is not None and option not in options and controller is not None:
        decision = choose_ratio(controller, segments)
        options[option] = decision.ratio
    return ResolvedMethod(get_method(method, **options), decision)


def choose_ratio(controller: LoadingController, segments: Sequence[Segment]) -> Decision:
    """The controller's ratio for a prompt: matched to the slowest tier its chunks load from."""
    sources = [s.kv for s in segments if s.kv is not None]
    cached = sum(source.num_tokens for source in sources)
    tier = "disk" if any(getattr(source, "tier", "ram") == "disk" for source in sources) else "ram"
    return controller.choose(cached, sum(len(s) for s in segments), tier)
