"""Structured output for :class:`~langchain_cacheblend.ChatCacheBlend`, following LangChain's
``with_structured_output`` contract, and the error ``bind_tools`` raises.

The schema becomes an OpenAI-style ``response_format`` bound to the model as a call option; the core turns
it into a JSON constraint that the engine enforces token by token while decoding (grammar-constrained
decoding), so even a small model's answer is JSON valid against the schema. LangChain's own output
parsers then read it: a Pydantic class gives an instance of it, a TypedDict or a JSON schema a dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from operator import itemgetter
from typing import Any, Literal

from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass
from typing_extensions import is_typeddict

from cacheblend_rag.frontend import response_format_for

StructuredMethod = Literal["json_schema", "json_mode", "function_calling"]
SUPPORTED_METHODS: tuple[str, ...] = ("json_schema", "json_mode", "function_calling")

TOOL_CALLING_UNSUPPORTED = (
    "ChatCacheBlend does not support tool calling (bind_tools): it serves small local models without a "
    "tool-calling chat template (the default, SmolLM2-135M-Instruct, has none), so tool choices and "
    "arguments could not be relied on. For typed results use with_structured_output(schema), which "
    "constrains decoding so that the answer is JSON valid against the schema."
)


class ToolCallingNotSupportedError(NotImplementedError):
    """Raised by ``ChatCacheBlend.bind_tools``: tool calling is not supported (the message says why)."""


def structured_output(
    model: BaseChatModel,
    schema: Mapping[str, Any] | type | None,
    *,
    method: StructuredMethod = "json_schema",
    include_raw: bool = False,
    strict: bool | None = None,
) -> Runnable[LanguageModelInput, Any]:
    """``model`` answering with JSON for ``schema``, parsed (see ``ChatCacheBlend.with_structured_output``).

    ``function_calling`` is served as ``json_schema`` (there is no tool calling; the schema is enforced
    while decoding instead), so code written for models that default to it works unchanged."""
    if method not in SUPPORTED_METHODS:
        raise ValueError(
            f"unknown structured output method {method!r}; supported: {', '.join(SUPPORTED_METHODS)} "
            "('function_calling' is served as 'json_schema': there is no tool calling)"
        )
    if schema is None and method != "json_mode":
        raise ValueError(f"method={method!r} needs a schema (a Pydantic class, a TypedDict or a JSON schema)")
    served = "json_mode" if method == "json_mode" else "json_schema"
    pydantic_class = isinstance(schema, type) and is_basemodel_subclass(schema)
    fmt = response_format_for(_json_schema(schema) if schema is not None else None, served, strict)
    options: dict[str, Any] = {"response_format": fmt}
    if schema is not None:  # what LangChain's tracing records as the requested structure
        options["ls_structured_output_format"] = {"kwargs": {"method": served}, "schema": schema}
    bound = model.bind(**options)
    parser: Runnable[Any, Any] = (
        PydanticOutputParser(pydantic_object=schema) if pydantic_class else JsonOutputParser()
    )
    if not include_raw:
        return bound | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=bound) | parsed.with_fallbacks([unparsed], exception_key="parsing_error")


def _json_schema(schema: Mapping[str, Any] | type) -> Mapping[str, Any] | type:
    """``schema`` as the core takes it: an OpenAI function or tool description (``{"name",
    "parameters"}`` or ``{"type": "function", "function": {...}}``) becomes the JSON schema of its
    parameters; classes and plain JSON schemas are taken as they are."""
    if isinstance(schema, Mapping):
        is_tool = schema.get("type") == "function" and isinstance(schema.get("function"), Mapping)
        is_function = "name" in schema and "parameters" in schema and "properties" not in schema
        if is_tool or is_function:
            return convert_to_json_schema(dict(schema))
        return schema
    if isinstance(schema, type) and (is_basemodel_subclass(schema) or is_typeddict(schema)):
        return schema
    raise ValueError(
        f"cannot use {schema!r} as an output schema: pass a Pydantic model class, a TypedDict class or a "
        "JSON schema dict"
    )
