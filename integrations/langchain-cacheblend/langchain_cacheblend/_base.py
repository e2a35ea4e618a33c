"""What the LLM and the chat model share: the core's generation options, adapted to LangChain types
(documents, usage metadata, tracing parameters)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from langchain_core.documents import Document
from langchain_core.language_models import LangSmithParams
from langchain_core.messages.ai import UsageMetadata

from cacheblend_rag.engine import GenerationResult
from cacheblend_rag.frontend import (
    PROVIDER,
    DocumentRef,
    GenerationOptions,
    TextRequest,
    TokenUsage,
    answer_report,
)


class CacheBlendParams(GenerationOptions):
    """Settings common to :class:`~langchain_cacheblend.ChatCacheBlend` and
    :class:`~langchain_cacheblend.CacheBlendLLM` (see :class:`~cacheblend_rag.frontend.GenerationOptions`
    for how chunk KV is found).

    Passing the documents explicitly (``llm.invoke(prompt, documents=docs)``, as
    :func:`~langchain_cacheblend.create_cacheblend_rag_chain` does) skips the text search and also covers
    documents from other retrievers. Per-call options (``invoke``/``stream``/``batch`` keywords, or
    ``bind``) override the fields of the same name for that call.
    """

    _ls_model_type: ClassVar[str]

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self.identifying_params()

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider=PROVIDER,
            ls_model_name=kwargs.get("model") or self.model_label(),
            ls_model_type=self._ls_model_type,
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
        )
        if stops := stop or self.stop:
            params["ls_stop"] = stops
        return params

    def _request(self, text: str, stop: list[str] | None, options: dict[str, Any]) -> TextRequest:
        options = dict(options)
        documents = self._document_refs(options.pop("documents", None) or ())
        if stop is not None:
            options["stop"] = stop
        return self.text_request(text, documents, options)

    def _document_refs(self, documents: Sequence[Document | str]) -> list[DocumentRef]:
        """Documents as the frontend takes them; a string is the id of a stored chunk."""
        refs: list[DocumentRef] = []
        for doc in documents:
            if isinstance(doc, str):
                refs.extend(self.chunk_documents([doc]))
            elif isinstance(doc, Document):
                refs.append(DocumentRef(doc.page_content, doc.metadata.get("chunk_id") or doc.id))
            else:
                raise TypeError(
                    f"documents must be langchain Documents or chunk ids, got {type(doc).__name__}"
                )
        return refs


def usage_metadata(result: GenerationResult) -> UsageMetadata:
    """Token counts; ``input_token_details.cache_read``: prompt tokens whose KV was read from a cache
    tier and kept; ``cache_creation``: chunk KV no tier held, computed (and stored) for this request
    (docs/accounting.md)."""
    usage = TokenUsage.of(result)
    return UsageMetadata(
        input_tokens=usage.input,
        output_tokens=usage.output,
        total_tokens=usage.total,
        input_token_details={"cache_read": usage.cached, "cache_creation": usage.kv_computed},
    )


def response_metadata(result: GenerationResult, model_name: str) -> dict[str, Any]:
    """What the engine reports about one answer (time to first token, method, recompute ratio, chunks,
    the loading controller's decision...), the answer's text left out."""
    report = {key: value for key, value in answer_report(result).items() if key != "text"}
    return {"model_name": model_name, "model_provider": PROVIDER, **report}
