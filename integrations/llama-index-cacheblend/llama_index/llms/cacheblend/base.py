"""``CacheBlendLLM``: a LlamaIndex LLM that answers with blended chunk KV caches."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
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
from llama_index.core.bridge.pydantic import Field
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.schema import BaseNode, NodeWithScore

from cacheblend_rag.engine import GenerationResult
from cacheblend_rag.frontend import DocumentRef, GenerationOptions, TextRequest, TokenUsage, answer_report

# What may be passed as ``documents``: retrieved nodes (their id and raw text) or stored chunk ids.
DocumentLike = NodeWithScore | BaseNode | str

_T = TypeVar("_T")


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
        for event in handle:
            text += event.text
            yield text, event.text, None
        result = handle.result()
        yield result.text, "", result

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
        "usage": {**counts, "prompt_tokens_details": {"cached_tokens": usage.cached}},
    }


def _usage(result: GenerationResult) -> dict[str, int]:
    usage = TokenUsage.of(result)
    return {
        "prompt_tokens": usage.input,
        "completion_tokens": usage.output,
        "total_tokens": usage.total,
        "cached_tokens": usage.cached,
    }
