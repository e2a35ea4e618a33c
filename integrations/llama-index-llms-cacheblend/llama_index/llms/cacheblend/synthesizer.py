"""``CacheBlendSynthesizer``: answer from retrieved nodes without losing which chunk each one is."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.callbacks import CallbackManager
from llama_index.core.llms.llm import astream_chat_response_to_tokens, stream_chat_response_to_tokens
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.default_prompt_selectors import DEFAULT_TEXT_QA_PROMPT_SEL
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import NodeWithScore, QueryType
from llama_index.core.types import RESPONSE_TEXT_TYPE

from cacheblend_rag.engine.prompt import CHUNK_SEPARATOR

from .base import CacheBlendLLM


class CacheBlendSynthesizer(BaseSynthesizer):
    """Fills the QA template with the nodes' texts (separated by blank lines, nothing truncated) and
    passes the nodes themselves to :class:`CacheBlendLLM`, so each node becomes a cached segment by id.

    Stock synthesizers hand the LLM flattened text only (and may cut or repack it); this one keeps
    chunk identity, so no text search is needed and nodes from any retriever are KV-cached on first sight.
    """

    def __init__(
        self,
        llm: CacheBlendLLM,
        text_qa_template: BasePromptTemplate | None = None,
        streaming: bool = False,
        callback_manager: CallbackManager | None = None,
    ) -> None:
        if not isinstance(llm, CacheBlendLLM):
            raise TypeError(f"CacheBlendSynthesizer needs a CacheBlendLLM, got {type(llm).__name__}")
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)
        self._text_qa_template = text_qa_template or DEFAULT_TEXT_QA_PROMPT_SEL

    def _get_prompts(self) -> PromptDictType:
        return {"text_qa_template": self._text_qa_template}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        if "text_qa_template" in prompts:
            self._text_qa_template = prompts["text_qa_template"]

    def synthesize(
        self,
        query: QueryType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ):
        return super().synthesize(query, nodes, additional_source_nodes, documents=nodes, **response_kwargs)

    async def asynthesize(
        self,
        query: QueryType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ):
        return await super().asynthesize(
            query, nodes, additional_source_nodes, documents=nodes, **response_kwargs
        )

    def _messages(self, query_str: str, text_chunks: Sequence[str]):
        return self._text_qa_template.format_messages(
            llm=self._llm, context_str=CHUNK_SEPARATOR.join(text_chunks), query_str=query_str
        )

    def get_response(
        self,
        query_str: str,
        text_chunks: Sequence[str],
        documents: Sequence[NodeWithScore] = (),
        **response_kwargs: Any,
    ) -> RESPONSE_TEXT_TYPE:
        messages = self._messages(query_str, text_chunks)
        if self._streaming:
            stream = self._llm.stream_chat(messages, documents=documents, **response_kwargs)
            return stream_chat_response_to_tokens(stream)
        return self._llm.chat(messages, documents=documents, **response_kwargs).message.content or ""

    async def aget_response(
        self,
        query_str: str,
        text_chunks: Sequence[str],
        documents: Sequence[NodeWithScore] = (),
        **response_kwargs: Any,
    ) -> RESPONSE_TEXT_TYPE:
        messages = self._messages(query_str, text_chunks)
        if self._streaming:
            stream = await self._llm.astream_chat(messages, documents=documents, **response_kwargs)
            return await astream_chat_response_to_tokens(stream)
        response = await self._llm.achat(messages, documents=documents, **response_kwargs)
        return response.message.content or ""
