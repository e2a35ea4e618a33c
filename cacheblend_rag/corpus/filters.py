"""Metadata filters on a corpus's documents, compiled to SQL so a search can restrict itself to the
documents that match before it ranks anything (never a filter applied to the top-k afterwards).

A filter is a tree of :class:`Condition` (one metadata key against a value), :class:`AllOf`, :class:`AnyOf`
and :class:`Not`. :func:`parse_filter` reads the dictionary form LangChain's vector stores use::

    {"genre": "poetry"}                                    # equality
    {"year": {"$gte": 1990}, "lang": {"$in": ["en", "de"]}}  # several keys: all must hold
    {"$or": [{"genre": "poetry"}, {"genre": "drama"}]}

Operators: ``$eq``, ``$ne``, ``$in``, ``$nin``, ``$gt``, ``$gte``, ``$lt``, ``$lte``, ``$contains`` (a list in
the metadata holds the value) and the combinators ``$and``, ``$or``, ``$not``. Values compare with their
JSON type: ``1`` matches the number 1, not the string ``"1"`` nor ``true``. A document without the key
matches ``$ne`` and ``$nin`` and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

OPERATORS = ("eq", "ne", "in", "nin", "gt", "gte", "lt", "lte", "contains")
_ORDERED = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}


@dataclass(frozen=True)
class Condition:
    """``metadata[key] <op> value``; ``in``/``nin`` take a list of values."""

    key: str
    op: str
    value: Any

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key or '"' in self.key:
            raise ValueError(f"metadata filter key must be a non-empty string without '\"', got {self.key!r}")
        if self.op not in OPERATORS:
            raise ValueError(f"unknown filter operator {self.op!r}; supported: {', '.join(OPERATORS)}")
        if self.op in ("in", "nin"):
            if isinstance(self.value, str | bytes) or not isinstance(self.value, Sequence):
                raise ValueError(f"${self.op} on {self.key!r} takes a list of values, got {self.value!r}")
            for item in self.value:
                _check_scalar(self.key, self.op, item)
        else:
            _check_scalar(self.key, self.op, self.value)
        if self.op in _ORDERED and (self.value is None or isinstance(self.value, bool)):
            raise ValueError(f"${self.op} on {self.key!r} compares numbers or strings, got {self.value!r}")


@dataclass(frozen=True)
class KeyIn:
    """The document's key (its id) is one of ``keys``."""

    keys: tuple[str, ...]


@dataclass(frozen=True)
class AllOf:
    parts: tuple[Filter, ...]


@dataclass(frozen=True)
class AnyOf:
    parts: tuple[Filter, ...]


@dataclass(frozen=True)
class Not:
    part: Filter


Filter = Condition | KeyIn | AllOf | AnyOf | Not


def _check_scalar(key: str, op: str, value: object) -> None:
    if not isinstance(value, str | int | float | bool | type(None)):
        raise ValueError(
            f"${op} on {key!r}: a filter value must be a string, number, boolean or null, "
            f"got {type(value).__name__}"
        )


def parse_filter(spec: Mapping[str, Any] | Filter | None) -> Filter | None:
    """A filter from LangChain's dictionary form (see the module doc); a filter object passes through."""
    if spec is None or isinstance(spec, Condition | KeyIn | AllOf | AnyOf | Not):
        return spec
    if not isinstance(spec, Mapping):
        raise ValueError(f"a metadata filter is a dict such as {{'key': value}}, got {type(spec).__name__}")
    parts: list[Filter] = []
    for key, value in spec.items():
        if key in ("$and", "$or"):
            if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value:
                raise ValueError(f"{key} takes a non-empty list of filters, got {value!r}")
            inner = tuple(parse_filter(v) for v in value)
            parts.append(AllOf(inner) if key == "$and" else AnyOf(inner))
        elif key == "$not":
            parts.append(Not(parse_filter(value)))
        elif isinstance(key, str) and key.startswith("$"):
            raise ValueError(f"unknown filter combinator {key!r}; supported: $and, $or, $not")
        elif isinstance(value, Mapping):
            if not value:
                raise ValueError(f"empty operator dict for metadata key {key!r}")
            for op, operand in value.items():
                if not isinstance(op, str) or not op.startswith("$"):
                    raise ValueError(f"filter operators start with '$' (e.g. $in), got {op!r} on {key!r}")
                parts.append(Condition(key, op[1:], operand))
        else:
            parts.append(Condition(key, "eq", value))
    if not parts:
        raise ValueError("an empty metadata filter: pass None for no filter")
    return parts[0] if len(parts) == 1 else AllOf(tuple(parts))


def to_sql(where: Filter, column: str, key_column: str = "d.key") -> tuple[str, list[Any]]:
    """An SQL boolean expression over the JSON text in ``column`` and the document key in ``key_column``
    (trusted column names), and its parameters. Unknown keys are false (never NULL), so ``NOT`` stays
    exact."""
    if isinstance(where, AllOf | AnyOf):
        if not where.parts:
            return ("(1)" if isinstance(where, AllOf) else "(0)"), []
        pieces = [to_sql(part, column, key_column) for part in where.parts]
        joiner = " AND " if isinstance(where, AllOf) else " OR "
        return "(" + joiner.join(p[0] for p in pieces) + ")", [x for p in pieces for x in p[1]]
    if isinstance(where, Not):
        sql, params = to_sql(where.part, column, key_column)
        return f"(NOT {sql})", params
    if isinstance(where, KeyIn):
        if not where.keys:
            return "(0)", []
        return f"({key_column} IN ({','.join('?' * len(where.keys))}))", list(where.keys)
    path = f'$."{where.key}"'
    if where.op in ("ne", "nin"):
        sql, params = to_sql(Condition(where.key, "eq" if where.op == "ne" else "in", where.value), column)
        return f"(NOT {sql})", params
    if where.op == "in":
        if not where.value:
            return "(0)", []
        pieces = [_metadata_equals(column, path, v) for v in where.value]
        return "(" + " OR ".join(p[0] for p in pieces) + ")", [x for p in pieces for x in p[1]]
    if where.op == "eq":
        return _metadata_equals(column, path, where.value)
    if where.op == "contains":
        element_sql, element_params = _equals("j.type", "j.value", [], where.value)
        return (
            f"(COALESCE(json_type({column}, ?) = 'array', 0) AND EXISTS "
            f"(SELECT 1 FROM json_each({column}, ?) j WHERE {element_sql}))",
            [path, path, *element_params],
        )
    kind = "'text'" if isinstance(where.value, str) else "'integer', 'real'"
    return (
        f"COALESCE(json_type({column}, ?) IN ({kind}) AND json_extract({column}, ?) "
        f"{_ORDERED[where.op]} ?, 0)",
        [path, path, where.value],
    )


def _metadata_equals(column: str, path: str, value: object) -> tuple[str, list[Any]]:
    return _equals(f"json_type({column}, ?)", f"json_extract({column}, ?)", [path], value)


def _equals(type_sql: str, value_sql: str, args: list[Any], value: object) -> tuple[str, list[Any]]:
    """The value at ``value_sql`` equals ``value`` and has its JSON type (``type_sql`` names the value's
    type); each of the two expressions takes ``args`` as its parameters."""
    if value is None:
        return f"COALESCE({type_sql} = 'null', 0)", [*args]
    if isinstance(value, bool):
        return f"COALESCE({type_sql} = '{'true' if value else 'false'}', 0)", [*args]
    kind = "'text'" if isinstance(value, str) else "'integer', 'real'"
    return f"COALESCE({type_sql} IN ({kind}) AND {value_sql} = ?, 0)", [*args, *args, value]
