"""Results records: one JSON object of a results file as a frozen dataclass that refuses what it does not
know, so a misspelt key fails where it is read rather than as a missing number in a table.

A record's fields are its object's keys. :meth:`JsonRecord.from_dict` refuses a key the record has no
field for and a missing key of a field without a default, naming the key and where it sits. A field whose
default is None is one that not every results file has (older files, or a measure an engine does not
report): None when the key is absent, and left out of :meth:`JsonRecord.to_dict` while None. A field
without a default is always written, None included. Nested records (also in lists and dict values) are
read and written by the fields' types. A record read from a file keeps the order of the file's keys
(older writers put some in another order), so a file read and written again is the same bytes.

An :class:`OpenRecord` keeps the keys it has no field for instead of refusing them (the bench's sections,
whose objects also hold the frame the bench adds). A record field made with ``field(metadata=INLINE)``
has its keys in its parent's object, where the field stands, not an object of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self, get_args, get_origin, get_type_hints

from .errors import EvalDataError

# the metadata of a record field whose keys stand in its parent's object, where the field stands
INLINE = {"inline": True}
# the metadata of a record's own bookkeeping (not a key of its object)
_BOOKKEEPING = {"bookkeeping": True}


@dataclass(frozen=True, kw_only=True)
class JsonRecord:
    """A JSON object of a results file (see the module's docstring)."""

    # the keys in the order the file had them; () for a record made here (its fields' order)
    key_order: tuple[str, ...] = field(default=(), compare=False, repr=False, metadata=_BOOKKEEPING)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in _fields(type(self)):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            if f.metadata.get("inline"):
                out.update(value.to_dict())
            else:
                out[f.name] = plain(value)
        out.update(plain(self._kept()))
        if self.key_order:  # the file's order first; keys it lacked after them, as a merge would add them
            out = {**{key: out[key] for key in self.key_order if key in out}, **out}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "") -> Self:
        """The record ``data`` holds; ``where`` names its place for errors (``results.json: cases[3]``)."""
        at = f"{where}: " if where else ""
        if not isinstance(data, Mapping):
            raise EvalDataError(f"{at}{cls.__name__} must be an object, got {type(data).__name__}")
        keys = _keys(cls)
        kept = cls._unknown({key: value for key, value in data.items() if key not in keys}, at)
        hints = _hints(cls)
        values = {}
        for f in _fields(cls):
            kind = hints[f.name]
            if f.metadata.get("inline"):
                inline = {key: value for key, value in data.items() if key in _keys(kind)}
                values[f.name] = kind.from_dict(inline, where)
            elif f.name in data:
                value = data[f.name]
                values[f.name] = _load(kind, value, f"{at}{f.name}") if _nested(kind) else value
            elif _required(f):
                raise EvalDataError(f"{at}{cls.__name__} lacks field {f.name!r}")
        return cls(**values, **kept, key_order=tuple(data))

    def _kept(self) -> dict[str, Any]:
        """Keys of the object that no field holds, written after the fields (none: refused when read)."""
        return {}

    @classmethod
    def _unknown(cls, unknown: dict[str, Any], at: str) -> dict[str, Any]:
        """What to do with keys no field holds: refuse them, naming the first."""
        if unknown:
            raise EvalDataError(
                f"{at}{cls.__name__} has no field {next(iter(unknown))!r} "
                f"(its fields: {', '.join(_keys(cls))})"
            )
        return {}


@dataclass(frozen=True, kw_only=True)
class OpenRecord(JsonRecord):
    """A record that keeps the keys it has no field for in ``extra`` and writes them back after its fields
    (what older or newer writers, or a frame around it, put in the same object), so a file read and
    written again is the same file."""

    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False, metadata=_BOOKKEEPING)

    def _kept(self) -> dict[str, Any]:
        return self.extra

    @classmethod
    def _unknown(cls, unknown: dict[str, Any], at: str) -> dict[str, Any]:
        return {"extra": unknown}


def plain(value: Any) -> Any:
    """``value`` as plain JSON data: records as their objects, also inside lists, tuples and dicts."""
    if isinstance(value, JsonRecord):
        return value.to_dict()
    if isinstance(value, dict):
        return {key: plain(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


@functools.cache
def _fields(cls: type[JsonRecord]) -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(cls) if not f.metadata.get("bookkeeping"))


@functools.cache
def _keys(cls: type[JsonRecord]) -> tuple[str, ...]:
    """The keys of ``cls``'s object: its fields', an inline field's own keys in its place."""
    hints = _hints(cls)
    keys: list[str] = []
    for f in _fields(cls):
        keys.extend(_keys(hints[f.name]) if f.metadata.get("inline") else [f.name])
    return tuple(keys)


@functools.cache
def _nested(kind: Any) -> bool:
    """Whether values of ``kind`` hold records (else they are read as the JSON has them)."""
    if isinstance(kind, type):
        return issubclass(kind, JsonRecord)
    return any(_nested(arg) for arg in get_args(kind))


@functools.cache
def _hints(cls: type[JsonRecord]) -> dict[str, Any]:
    return get_type_hints(cls)


def _load(kind: Any, value: Any, where: str) -> Any:
    """``value`` (plain JSON) as ``kind``: records where the type names one, else as it is."""
    if value is None:
        return None
    origin = get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        kinds = [k for k in get_args(kind) if k is not type(None)]
        return _load(kinds[0], value, where) if len(kinds) == 1 else value
    if isinstance(kind, type) and issubclass(kind, JsonRecord):
        return kind.from_dict(value, where)
    if origin is dict and isinstance(value, Mapping) and _nested(kind):
        inner = get_args(kind)[1]
        return {key: _load(inner, v, f"{where} {key!r}") for key, v in value.items()}
    if origin is list and isinstance(value, list) and _nested(kind):
        inner = get_args(kind)[0]
        return [_load(inner, v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value
