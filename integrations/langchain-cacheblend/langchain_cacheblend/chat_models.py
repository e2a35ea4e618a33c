"""``ChatCacheBlend``: a LangChain chat model that answers with blended chunk KV caches."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from pydantic import BaseModel, Field

from cacheblend_rag.frontend import TextRequest

from ._base import CacheBlendParams, response_metadata, usage_metadata
from .structured import (
    TOOL_CALLING_UNSUPPORTED,
    StructuredMethod,
    ToolCallingNotSupportedError,
    structured_output,
)

# A message may name the stored chunks pasted into it: HumanMessage(text, additional_kwargs={KEY: [ids]}).
MESSAGE_CHUNK_IDS_KEY = "cacheblend_chunk_ids"

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}


class ChatCacheBlend(CacheBlendParams, BaseChatModel):
    """Chat model over the cacheblend-rag engine (the model's own chat template is applied).

    Drop it into any chain in place of another chat model; see :class:`CacheBlendParams` for how chunk KV
    is found. Each answer's ``usage_metadata["input_token_details"]["cache_read"]`` counts the prompt tokens
    whose KV was reused, and ``response_metadata`` holds ``ttft_s``, ``method``, ``recompute_ratio`` and
    ``chunk_ids``. Structured output (:meth:`with_structured_output`) is decoded under a JSON constraint;
    text input only, and no tool calling (:meth:`bind_tools` raises, saying why).

    Example:
        .. code-block:: python

            llm = ChatCacheBlend(corpus_dir="my-corpus", max_tokens=128)
            chain = retriever | format_docs | prompt | llm
            typed = prompt | llm.with_structured_output(Answer)  # Answer: a Pydantic class
    """

    streaming: bool = Field(default=False, description="Stream through callbacks even on invoke.")
    _ls_model_type: ClassVar[str] = "chat"

    @property
    def _llm_type(self) -> str:
        return "cacheblend-chat"

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: StructuredMethod = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """A runnable that answers with an object of ``schema``: a Pydantic class (an instance of it), a
        TypedDict class or a JSON schema dict (a dict; an OpenAI function or tool description is taken
        as the schema of its parameters).

        ``method="json_schema"`` (default) constrains decoding to JSON valid against the schema, so the
        answer always parses (given ``max_tokens`` room for it: the decoder steers to close the JSON
        before the budget runs out). ``"json_mode"`` constrains it to any JSON object and parses that with
        the schema: say in the prompt which keys to use. ``"function_calling"`` is served as
        ``json_schema``, since there is no tool calling. ``strict`` (default True): objects get no keys
        beyond the schema's unless it allows them. ``include_raw=True`` returns ``{"raw": AIMessage,
        "parsed": ..., "parsing_error": ...}`` and never raises on a parsing error. Works in any chain
        (``prompt | llm.with_structured_output(Answer)``), streaming partial objects too; chunk KV is
        reused as for plain answers."""
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        return structured_output(self, schema, method=method, include_raw=include_raw, strict=strict)

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Not supported: raises :class:`ToolCallingNotSupportedError` saying why (use
        :meth:`with_structured_output` for typed answers)."""
        raise ToolCallingNotSupportedError(TOOL_CALLING_UNSUPPORTED)

    def _chat_request(
        self, messages: Sequence[BaseMessage], stop: list[str] | None, options: dict[str, Any]
    ) -> TextRequest:
        chat, chunk_ids = _to_chat(messages)
        if chunk_ids:
            options = {**options, "documents": [*(options.get("documents") or ()), *chunk_ids]}
        return self._request(self.frontend.render_chat(chat), stop, options)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        result = self.stream_answer(self._chat_request(messages, stop, kwargs)).result()
        meta = response_metadata(result, self.frontend.model_name)
        message = AIMessage(
            content=result.text, usage_metadata=usage_metadata(result), response_metadata=meta
        )
        return ChatResult(
            generations=[
                ChatGeneration(message=message, generation_info={"finish_reason": result.finish_reason})
            ],
            llm_output={"model_name": meta["model_name"]},
        )

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        handle = self.stream_answer(self._chat_request(messages, stop, kwargs))
        try:
            for event in handle:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=event.text))
                if run_manager is not None:
                    run_manager.on_llm_new_token(event.text, chunk=chunk)
                yield chunk
            result = handle.result()
        finally:
            handle.cancel()  # a consumer that stopped early: the request stops decoding
        # Usage and metadata once, on the closing chunk, so that adding chunks up counts them once.
        yield ChatGenerationChunk(
            message=AIMessageChunk(
                content="",
                usage_metadata=usage_metadata(result),
                response_metadata=response_metadata(result, self.frontend.model_name),
                chunk_position="last",
            ),
            generation_info={"finish_reason": result.finish_reason},
        )


def _to_chat(messages: Sequence[BaseMessage]) -> tuple[list[dict[str, str]], list[str]]:
    """({role, content} dicts for the chat template, chunk ids named by the messages)."""
    chat: list[dict[str, str]] = []
    chunk_ids: list[str] = []
    for message in messages:
        role = message.role if isinstance(message, ChatMessage) else _ROLES.get(message.type)
        if role is None:
            raise ValueError(f"ChatCacheBlend cannot take a {message.type!r} message")
        chat.append({"role": role, "content": _text(message)})
        chunk_ids.extend(message.additional_kwargs.get(MESSAGE_CHUNK_IDS_KEY, ()))
    return chat, chunk_ids


def _text(message: BaseMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text":
            parts.append(block["text"])
        else:
            raise ValueError(f"ChatCacheBlend takes text only; a message holds a {block.get('type')!r} block")
    return "".join(parts)
