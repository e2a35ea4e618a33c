"""Naming a method and resolving a request's method: :class:`MethodSpec` (``cacheblend``,
``cacheblend@0.15``, ``cacheblend_hkvd@ratio=0.15,signal=v``) and :func:`resolve_method`, which applies
the loading controller when a method's ratio is not given."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import MethodOptionError
from .controller import Decision, LoadingController
from .methods import (
    RecomputeMethod,
    Reuse,
    canonical_options,
    get_method,
    jsonable,
    method_class,
    options_help,
)
from .segments import Segment, kv_sources


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
                    f"cacheblend@0.15); {options_help(method)}"
                )
            given = {method.shorthand: _parse_value(parts[0])}
        else:
            given = {}
            for part in parts:
                key, eq, value = part.partition("=")
                if not eq or not key.strip():
                    raise MethodOptionError(f"{text!r}: expected option=value, got {part!r}")
                given[key.strip()] = _parse_value(value.strip())
        # an older spelling (cacheblend@selection=hkvd) is labelled as the method it names
        name, given = canonical_options(name, given)
        options = get_method(name, **given).spec_options(given)
        return cls(_label(method_class(name), options), name, options)

    def build(self) -> RecomputeMethod:
        return get_method(self.name, **dict(self.options))

    def with_ratio(self, ratio: float | None, *, where_taken: bool = False) -> MethodSpec:
        """This spec with its recompute ratio set to ``ratio`` (unchanged when it is None). A method
        without a ratio refuses one by name, unless ``where_taken`` (a sweep applying one ratio to every
        method it runs: those without one run as they are)."""
        option = self.method_class.ratio_option
        if ratio is None:
            return self
        if option is None:
            if where_taken:
                return self
            raise MethodOptionError(
                f"method {self.name!r} takes no ratio (ratio {ratio:g} given); "
                f"{options_help(self.method_class)}"
            )
        options = {**dict(self.options), option: ratio}
        get_method(self.name, **options)  # refuses a ratio outside the method's bounds
        items = tuple(options.items())
        return MethodSpec(_label(self.method_class, items), self.name, items)

    def with_options(self, options: Mapping[str, Any]) -> MethodSpec:
        """This spec with ``options`` set over its own (checked by the method)."""
        if not options:
            return self
        merged = {**dict(self.options), **options}
        given = get_method(self.name, **merged).spec_options(merged)
        return MethodSpec(_label(self.method_class, given), self.name, given)

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


DEFAULT_NAME = "default"  # names the settings' method where a list of specs is given (eval, check)


def named_default(text: str, default: str) -> str:
    """``text``, or ``default`` (the settings' method, as ``query`` runs it) where ``text`` is
    ``default``."""
    return default if text.strip() == DEFAULT_NAME else text


def split_specs(text: str) -> list[str]:
    """A comma-separated list of method specs, e.g. ``full_reuse,cacheblend@ratio=0.3,shift=false,epic@32``:
    an ``option=value`` item without ``@`` continues the spec before it."""
    specs: list[str] = []
    for part in _split_options(text):
        if not part:
            continue
        if "=" in part and "@" not in part and specs:
            specs[-1] += "," + part
        else:
            specs.append(part)
    return specs


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
        return value if isinstance(value, str) else json.dumps(jsonable(value), separators=(",", ":"))

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
    """The controller's ratio for a prompt: matched to the tier where its chunks' KV lives, the disk for
    KV a store keeps (read from any of its tiers, or computed for this request and stored), RAM only
    for KV the caller holds in memory. Not the tier a read happens to hit: the RAM tier holds what ran
    lately, so the same request would get another ratio before and after another one ran."""
    sources = kv_sources(segments)
    cached = sum(source.num_tokens for source in sources)
    # a store's sources name their tier (RAM, disk, remote); the controller profiles RAM and disk, and a
    # remote chunk loads at least as slowly as one from disk. (A template's opening, exact, is held in
    # memory once read or computed: it says nothing of where the chunks live.)
    chunks = [s for s in segments if s.is_cached and not s.exact]
    stored = any(hasattr(s.kv, "tier") or s.computed for s in chunks)
    return controller.choose(cached, sum(len(s) for s in segments), "disk" if stored else "ram")
