"""``CacheBlendLLM``: a LlamaIndex LLM that answers with blended chunk KV caches."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator, Sequence
from typing import Any, TypeVar

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
)
from llama_index.core.bridge.pydantic import BaseModel, Field
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.prompts import PromptTemplate
from llama_index.core.schema import BaseNode, NodeWithScore
from llama_index.core.types import PydanticProgramMode

from cacheblend_rag.engine import GenerationResult
from cacheblend_rag.frontend import (
    DocumentRef,
    GenerationOptions,
    TextRequest,
    TokenUsage,
    answer_report,
    response_format_for,
)

# What may be passed as ``documents``: retrieved nodes (their id and raw text) or stored chunk ids.
DocumentLike = NodeWithScore | BaseNode | str

_T = TypeVar("_T")
_M = TypeVar("_M", bound=BaseModel)


class CacheBlendLLM(GenerationOptions, CustomLLM):
    """LLM over the cacheblend-rag engine; the model's own chat template is applied.

    Chunk KV is reused two ways. A prompt that contains the exact text of stored chunks (any stock query
    engine over :class:`~llama_index.retrievers.cacheblend.CacheBlendRetriever`) has those spans
    recognised; and ``documents=`` (nodes or chunk ids, as
    :class:`~llama_index.llms.cacheblend.CacheBlendSynthesizer` passes them) names the chunks in the
    prompt outright. Documents the corpus lacks are added to it and their KV computed on first sight.

    Each response's ``raw`` holds the engine's full report (``ttft_s``, ``method``, ``recompute_ratio``,
    ``chunk_ids``...) and ``raw["usage"]`` the token counts as LlamaIndex's OpenAI LLMs report them
    (``prompt_tokens``, ``completion_tokens``, ``total_tokens``, ``prompt_tokens_details.cached_tokens`` =
    prompt tokens whose KV was reused), so ``TokenCountingHandler`` counts them; ``additional_kwargs``
    hold the same counts flat (``cached_tokens``). Objects over the same corpus and model share one engine
    in the process; ``close()`` gives this object's hold back.

    Structured output: ``structured_predict(OutputCls, prompt)`` (and its streamed and async forms, and
    ``as_structured_llm(OutputCls)``) runs LlamaIndex's own text-completion program with the answer decoded
    under ``OutputCls``'s JSON schema, so it always parses; ``response_format=`` (an OpenAI-style dict) is
    also a call option of ``chat``/``complete``.
    """

    apply_chat_template: bool = Field(
        default=True, description="complete(): send the prompt as a user turn of the chat template."
    )

    @classmethod
    def class_name(cls) -> str:
        return "CacheBlendLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.frontend.context_window,
            num_output=self.max_tokens,
            is_chat_model=True,
            model_name=self.model or self.frontend.model_name,
        )

    # -- requests ------------------------------------------------------------------------------------

    def _request(self, text: str, options: dict[str, Any]) -> TextRequest:
        documents = self._document_refs(options.pop("documents", None) or ())
        return self.text_request(text, documents, options)

    def _document_refs(self, documents: Sequence[DocumentLike]) -> list[DocumentRef]:
        refs: list[DocumentRef] = []
        for doc in documents:
            node = doc.node if isinstance(doc, NodeWithScore) else doc
            if isinstance(node, str):
                refs.extend(self.chunk_documents([node]))
            elif isinstance(node, BaseNode):
                refs.append(DocumentRef(node.get_content(), node.node_id))
            else:
                raise TypeError(f"documents must be nodes or chunk ids, got {type(doc).__name__}")
        return refs

    def _completion_text(self, prompt: str, formatted: bool) -> str:
        if not self.apply_chat_template:
            return prompt if formatted else self.completion_to_prompt(prompt)
        turns = (
            [ChatMessage(role=MessageRole.SYSTEM, content=self.system_prompt)] if self.system_prompt else []
        )
        return self._chat_text([*turns, ChatMessage(role=MessageRole.USER, content=prompt)])

    def _chat_text(self, messages: Sequence[ChatMessage]) -> str:
        return self.frontend.render_chat([{"role": m.role.value, "content": _text(m)} for m in messages])

    def _run(self, request: TextRequest) -> GenerationResult:
        return self.stream_answer(request).result()

    def _stream_texts(self, request: TextRequest) -> Iterator[tuple[str, str, GenerationResult | None]]:
        """(text so far, delta, None) per token, then (full text, "", result) once at the end."""
        handle = self.stream_answer(request)
        text = ""
        try:
            for event in handle:
                text += event.text
                yield text, event.text, None
            result = handle.result()
        finally:
            handle.cancel()  # a consumer that stopped early: the request stops decoding
        yield result.text, "", result

    # -- structured output ---------------------------------------------------------------------------

    def _structured_kwargs(self, output_cls: type[BaseModel], llm_kwargs: dict[str, Any] | None) -> dict:
        """The program's LLM call options with the JSON constraint for ``output_cls`` added: LlamaIndex's
        text-completion program (what ``structured_predict`` runs for a model without function calling)
        passes them to ``chat``/``complete``, so the answer is decoded as JSON valid for the class and
        then parsed by the program. Other program modes build their own requests: left as they are."""
        llm_kwargs = dict(llm_kwargs or {})
        if self.pydantic_program_mode in (PydanticProgramMode.DEFAULT, PydanticProgramMode.LLM):
            llm_kwargs.setdefault("response_format", response_format_for(output_cls))
        return llm_kwargs

    def structured_predict(
        self,
        output_cls: type[_M],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **args: Any,
    ) -> _M:
        """An ``output_cls`` object, decoded under its JSON schema (``as_structured_llm`` comes here too)."""
        return super().structured_predict(
            output_cls, prompt, self._structured_kwargs(output_cls, llm_kwargs), **args
        )

    async def astructured_predict(
        self,
        output_cls: type[_M],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **args: Any,
    ) -> _M:
        kwargs = self._structured_kwargs(output_cls, llm_kwargs)
        return await super().astructured_predict(output_cls, prompt, kwargs, **args)

    def stream_structured_predict(
        self,
        output_cls: type[_M],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **args: Any,
    ) -> Generator[Any, None, None]:
        kwargs = self._structured_kwargs(output_cls, llm_kwargs)
        return super().stream_structured_predict(output_cls, prompt, kwargs, **args)

    async def astream_structured_predict(
        self,
        output_cls: type[_M],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **args: Any,
    ) -> AsyncGenerator[Any, None]:
        kwargs = self._structured_kwargs(output_cls, llm_kwargs)
        return await super().astream_structured_predict(output_cls, prompt, kwargs, **args)

    # -- completion ----------------------------------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        result = self._run(self._request(self._completion_text(prompt, formatted), kwargs))
        return CompletionResponse(text=result.text, raw=_raw(result), additional_kwargs=_usage(result))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        request = self._request(self._completion_text(prompt, formatted), kwargs)

        def gen() -> CompletionResponseGen:
            for text, delta, result in self._stream_texts(request):
                if result is None:
                    yield CompletionResponse(text=text, delta=delta)
                else:
                    yield CompletionResponse(
                        text=text, delta="", raw=_raw(result), additional_kwargs=_usage(result)
                    )

        return gen()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await asyncio.to_thread(self.complete, prompt, formatted, **kwargs)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        return _in_thread(lambda: self.stream_complete(prompt, formatted, **kwargs))

    # -- chat ----------------------------------------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        result = self._run(self._request(self._chat_text(messages), kwargs))
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, content=result.text),
            raw=_raw(result),
            additional_kwargs=_usage(result),
        )

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        request = self._request(self._chat_text(messages), kwargs)

        def gen() -> ChatResponseGen:
            for text, delta, result in self._stream_texts(request):
                message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
                if result is None:
                    yield ChatResponse(message=message, delta=delta)
                else:
                    yield ChatResponse(
                        message=message, delta="", raw=_raw(result), additional_kwargs=_usage(result)
                    )

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await asyncio.to_thread(self.chat, messages, **kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        return _in_thread(lambda: self.stream_chat(messages, **kwargs))


async def _in_thread(make: Callable[[], Iterator[_T]]) -> AsyncIterator[_T]:
    """Drive a blocking generator from worker threads, one item at a time, so the event loop stays free."""
    iterator = await asyncio.to_thread(make)
    done = object()
    while (item := await asyncio.to_thread(next, iterator, done)) is not done:
        yield item


def _text(message: ChatMessage) -> str:
    parts = []
    for block in message.blocks:
        if not isinstance(block, TextBlock):
            raise ValueError(f"CacheBlendLLM takes text only; a message holds a {type(block).__name__}")
        parts.append(block.text)
    return "".join(parts)


def _raw(result: GenerationResult) -> dict[str, Any]:
    """The engine's report, with the token counts under ``usage`` as OpenAI-style responses carry them."""
    usage = TokenUsage.of(result)
    counts = {"prompt_tokens": usage.input, "completion_tokens": usage.output, "total_tokens": usage.total}
    return {
        **answer_report(result),
        "usage": {
            **counts,
            "prompt_tokens_details": {"cached_tokens": usage.cached, **usage.details()},
        },
    }


def _usage(result: GenerationResult) -> dict[str, int]:
    usage = TokenUsage.of(result)
    return {
        "prompt_tokens": usage.input,
        "completion_tokens": usage.output,
        "total_tokens": usage.total,
        "cached_tokens": usage.cached,
        **usage.details(),
    }
