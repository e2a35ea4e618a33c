"""Typed bench results: each section's runner returns a frozen dataclass (a :class:`Record`) and its
renderer reads one; the results file keeps plain JSON objects, written and read back exactly as before.

A record's fields are the JSON object's keys, in the order the file has them. :meth:`Record.to_dict`
writes nested records as objects (also inside lists and dicts); :meth:`Record.from_dict` reads them back
by the fields' types. Keys a record has no field for (the frame the bench adds to every section: its
seconds, load average and machine; or whatever an older or newer writer put there) are kept aside in
``extra`` and written back after the fields, so a file read and written again is the same file. A field
made with ``field(default=None, metadata=OPTIONAL)`` is one older results lack: None when the key is
absent, and the key left out when None. A record field made with ``field(metadata=INLINE)`` has its keys
in its parent's object, where the field stands (not an object of its own).
"""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

R = TypeVar("R", bound="Record")

# the metadata of a field older results lack, and of a record whose keys are its parent's (see above)
OPTIONAL = {"optional": True}
INLINE = {"inline": True}


@dataclass(frozen=True)
class Record:
    """A JSON object of the bench results file, as a frozen dataclass (see the module's docstring)."""

    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False, kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in _fields(type(self)):
            value = getattr(self, f.name)
            if value is None and f.metadata.get("optional"):
                continue
            if f.metadata.get("inline"):
                out.update(value.to_dict())
            else:
                out[f.name] = _dump(value)
        out.update(_dump(self.extra))
        return out

    @classmethod
    def from_dict(cls: type[R], data: dict[str, Any]) -> R:
        values, known = {}, set()
        for f in _fields(cls):
            kind = _hints(cls)[f.name]
            if f.metadata.get("inline"):
                keys = {g.name for g in _fields(kind)}
                values[f.name] = kind.from_dict({k: v for k, v in data.items() if k in keys})
                known |= keys
            elif f.name in data:
                values[f.name] = _load(kind, data[f.name])
                known.add(f.name)
        return cls(**values, extra={k: v for k, v in data.items() if k not in known})


@dataclass(frozen=True)
class Check(Record):
    """A claim checked on a run's numbers; ``value`` (the number it was decided on) where there is one."""

    claim: str
    passed: bool
    value: float | None = field(default=None, metadata=OPTIONAL)


@dataclass(frozen=True)
class LoadAverage(Record):
    """The 1-, 5- and 15-minute load averages before and after a section ran."""

    before: list[float]
    after: list[float]


@dataclass(frozen=True)
class SectionFrame(Record):
    """What the bench adds to every section's results beside the section's own record: the seconds it
    took, the load averages around it and the machine it ran on (:func:`..results.machine_info`)."""

    seconds: float
    load_average: LoadAverage
    machine: dict[str, Any]


@functools.cache
def _fields(cls: type[Record]) -> tuple[Any, ...]:
    return tuple(f for f in fields(cls) if f.name != "extra")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _dump(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_dump(v) for v in value]
    return value


def _load(kind: Any, value: Any) -> Any:
    """``value`` (plain JSON) as ``kind``: records where the type names one, else as it is."""
    if value is None:
        return None
    origin = get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        (kind, *others) = [k for k in get_args(kind) if k is not type(None)]
        return value if others else _load(kind, value)
    if isinstance(kind, type) and issubclass(kind, Record):
        return kind.from_dict(value)
    if origin is dict:
        return {k: _load(get_args(kind)[1], v) for k, v in value.items()}
    if origin is list:
        return [_load(get_args(kind)[0], v) for v in value]
    return value
