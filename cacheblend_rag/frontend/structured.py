"""Structured output as the integrations and the server ask for it.

Every entry point describes the output it wants the way OpenAI's API does, as a ``response_format``:
``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}`` (JSON valid
against a schema) or ``{"type": "json_object"}`` (any JSON object). The dict is plain JSON, so a framework
can bind it to a model, trace it and use it in cache keys; :func:`constraint_of` turns it into the
request's :class:`~cacheblend_rag.engine.JsonConstraint` (``SamplingParams.constraint``), which both engines
enforce while decoding (see docs/structured_output.md). :func:`response_format_for` writes one for a
Pydantic model class, a TypedDict class or a JSON schema dict.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from ..engine import JsonConstraint
from ..engine.constraints import schema_of

ResponseFormat = dict[str, Any]
STRUCTURED_METHODS = ("json_schema", "json_mode")
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_-]+")


def response_format_for(
    schema: Mapping[str, Any] | type | None,
    method: Literal["json_schema", "json_mode"] = "json_schema",
    strict: bool | None = None,
) -> ResponseFormat:
    """The ``response_format`` that asks for ``schema`` (a Pydantic model class, a TypedDict class or a
    JSON schema dict): ``json_schema`` enforces it, ``json_mode`` only a JSON object (the schema is then
    for the caller to parse with). ``strict``: no keys beyond an object's listed properties unless the
    schema allows them (default True; see :func:`~cacheblend_rag.engine.constraints.strict_schema`).
    The schema is checked here: one the decoder cannot enforce raises
    :class:`~cacheblend_rag.errors.StructuredOutputError` naming the feature."""
    if method == "json_mode":
        return {"type": "json_object"}
    if method != "json_schema":
        raise ValueError(
            f"unknown structured output method {method!r}; supported: {', '.join(STRUCTURED_METHODS)}"
        )
    if schema is None:
        raise ValueError("method='json_schema' needs a schema (a Pydantic model, a TypedDict or a dict)")
    json_schema = schema_of(schema)
    strict = True if strict is None else strict
    JsonConstraint(json_schema, strict=strict)  # refuse a schema the decoder cannot enforce, now
    name = getattr(schema, "__name__", None) or json_schema.get("title") or "output"
    return {
        "type": "json_schema",
        "json_schema": {
            "name": _NAME_CHARS.sub("_", str(name))[:64],
            "schema": json_schema,
            "strict": strict,
        },
    }


def constraint_of(response_format: Mapping[str, Any] | JsonConstraint | None) -> JsonConstraint | None:
    """The decoding constraint a ``response_format`` asks for (None for no format or ``{"type":
    "text"}``); a :class:`JsonConstraint` is taken as it is. ``json_schema.strict`` defaults to True. A
    malformed format raises ``ValueError``, a schema the decoder cannot enforce
    :class:`~cacheblend_rag.errors.StructuredOutputError`."""
    if response_format is None or isinstance(response_format, JsonConstraint):
        return response_format
    if not isinstance(response_format, Mapping):
        raise ValueError(
            "response_format must be a dict such as {'type': 'json_object'} or {'type': 'json_schema', "
            f"'json_schema': {{'schema': {{...}}}}}}, got {type(response_format).__name__}"
        )
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonConstraint.json_mode()
    if kind != "json_schema":
        raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, Mapping) else None
    if not isinstance(schema, Mapping):
        raise ValueError("response_format.json_schema.schema must be a JSON schema object")
    strict = spec.get("strict")
    return JsonConstraint(dict(schema), strict=True if strict is None else bool(strict))
