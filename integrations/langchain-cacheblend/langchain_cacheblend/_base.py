"""What the LLM and the chat model share: settings, request building and result reporting."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from langchain_core.documents import Document
from langchain_core.messages.ai import UsageMetadata
from pydantic import BaseModel, Field, field_validator

from cacheblend_rag.blend.methods import MethodSpec
from cacheblend_rag.corpus.chunkdb import StoreManifest
from cacheblend_rag.engine import GenerationResult, RequestHandle
from cacheblend_rag.frontend import DocumentRef, PromptFrontend, TextRequest, get_frontend, text_request
from cacheblend_rag.settings import get_settings

PROVIDER = "cacheblend"

# Per-call options a caller may pass to invoke/stream/batch (or bind): they override the fields of the same
# name for that call. ``documents`` are the documents pasted into the prompt (see CacheBlendParams).
CALL_OPTIONS = frozenset({"documents", "method", "ratio", "max_tokens", "temperature", "top_p", "seed"})


class CacheBlendParams(BaseModel):
    """Settings common to :class:`~langchain_cacheblend.ChatCacheBlend` and
    :class:`~langchain_cacheblend.CacheBlendLLM`.

    Every object over the same ``store_dir`` and ``model`` shares one engine in the process.

    How chunk KV is reused: when a prompt contains the exact text of stored chunks (a standard
    ``retriever | format_docs | prompt | llm`` chain with :class:`~langchain_cacheblend.CacheBlendRetriever`),
    those spans are recognised and their stored KV is blended in. Passing the documents explicitly
    (``llm.invoke(prompt, documents=docs)``, as :func:`~langchain_cacheblend.create_cacheblend_rag_chain`
    does) skips the search and also covers documents from other retrievers: those are added to the store
    and their KV computed on first sight, so later prompts reuse them.
    """

    store_dir: str | None = Field(
        default=None, description="Store built by `cacheblend-rag ingest`; None: no chunk recognition."
    )
    model: str | None = Field(
        default=None, description="Model name or folder (default: the store's model, else the settings')."
    )
    method: str = Field(default_factory=lambda: get_settings().method, description="PIC method.")
    ratio: float | None = Field(
        default=None, ge=0.0, le=1.0, description="CacheBlend recompute ratio (default: the settings')."
    )
    max_tokens: int = Field(default=256, ge=1, description="Most tokens to generate.")
    temperature: float = Field(default=0.0, ge=0.0, description="0 is greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, description="Sampling seed (with temperature > 0).")
    stop: list[str] | None = Field(default=None, description="Stop strings (excluded from the output).")
    recognise_chunks: bool = Field(
        default=True, description="Search prompts for the text of stored chunks to reuse their KV."
    )
    remember_documents: bool = Field(
        default=True, description="Add explicitly passed documents the store lacks to it."
    )

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        MethodSpec.parse(value)  # an unknown method or a bad option is refused here, naming the problem
        return value

    def _frontend(self) -> PromptFrontend:
        return get_frontend(self.store_dir, self.model)

    def _model_label(self) -> str:
        """The model's name without loading it (for tracing parameters)."""
        if self.model:
            return Path(self.model).name
        manifest = StoreManifest.load(Path(self.store_dir).expanduser()) if self.store_dir else None
        return manifest.model if manifest is not None else get_settings().model

    def _request(self, text: str, stop: list[str] | None, options: dict[str, Any]) -> TextRequest:
        unknown = set(options) - CALL_OPTIONS
        if unknown:
            supported = ", ".join(sorted(CALL_OPTIONS))
            raise TypeError(f"unsupported option(s) {', '.join(sorted(unknown))}; supported: {supported}")
        return text_request(
            text,
            self._document_refs(options.get("documents") or ()),
            method=options.get("method", self.method),
            ratio=options.get("ratio", self.ratio),
            max_tokens=options.get("max_tokens", self.max_tokens),
            temperature=options.get("temperature", self.temperature),
            top_p=options.get("top_p", self.top_p),
            seed=options.get("seed", self.seed),
            stop=stop if stop is not None else self.stop,
        )

    def _document_refs(self, documents: Sequence[Document | str]) -> list[DocumentRef]:
        """Documents as the frontend takes them; a string is the id of a stored chunk."""
        refs: list[DocumentRef] = []
        for doc in documents:
            if isinstance(doc, str):
                refs.extend(self._frontend().chunk_documents([doc]))
            elif isinstance(doc, Document):
                refs.append(DocumentRef(doc.page_content, doc.metadata.get("chunk_id") or doc.id))
            else:
                raise TypeError(
                    f"documents must be langchain Documents or chunk ids, got {type(doc).__name__}"
                )
        return refs

    def _tokens(self, request: TextRequest) -> RequestHandle:
        """The answer's handle: its tokens as generated, then its result."""
        return self._frontend().stream(request, self.recognise_chunks, self.remember_documents)


def usage_metadata(result: GenerationResult) -> UsageMetadata:
    """Token counts; ``input_token_details.cache_read`` is the number of prompt tokens whose KV was reused."""
    output = len(result.token_ids)
    return UsageMetadata(
        input_tokens=result.prompt_tokens,
        output_tokens=output,
        total_tokens=result.prompt_tokens + output,
        input_token_details={"cache_read": result.reused_tokens},
    )


def response_metadata(result: GenerationResult, model_name: str) -> dict[str, Any]:
    """What the engine reports about one answer: time to first token, method, recompute ratio, chunks."""
    return {
        "model_name": model_name,
        "model_provider": PROVIDER,
        "finish_reason": result.finish_reason,
        "ttft_s": result.ttft_s,
        "total_s": result.total_s,
        "method": result.method,
        "method_options": result.method_options,
        "recompute_ratio": result.recompute_ratio,
        "reused_tokens": result.reused_tokens,
        "computed_tokens": result.computed_tokens,
        "chunk_ids": list(result.chunk_ids),
    }
