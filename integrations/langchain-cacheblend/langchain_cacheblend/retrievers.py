"""``CacheBlendRetriever``: LangChain retriever over an ingested cacheblend-rag corpus."""

from __future__ import annotations

import os
from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import Field, field_validator, model_validator

from cacheblend_rag.corpus import RetrievedChunk
from cacheblend_rag.frontend import get_corpus
from cacheblend_rag.frontend.options import refuse_former_names
from cacheblend_rag.settings import get_settings


class CacheBlendRetriever(BaseRetriever):
    """Top-``k`` chunks of a corpus for a query, as ``Document``s.

    Each document's ``id`` and ``metadata["chunk_id"]`` are the chunk id and its ``page_content`` is the
    chunk's text exactly as stored, so :class:`~langchain_cacheblend.ChatCacheBlend` recognises it in a
    prompt and reuses its precomputed KV. ``metadata`` also holds ``score`` (cosine similarity), ``title``
    and the chunk's provenance (``source``, ``start``, ``end``...). ``k`` may be given per call:
    ``retriever.invoke(query, k=3)``.
    """

    corpus_dir: str = Field(
        description="Corpus directory (str or Path) built by `cacheblend-rag ingest`.",
    )
    k: int = Field(default_factory=lambda: get_settings().top_k, ge=1, description="Documents to return.")

    @model_validator(mode="before")
    @classmethod
    def _no_former_names(cls, data: Any) -> Any:
        refuse_former_names(data)
        return data

    @field_validator("corpus_dir", mode="before")
    @classmethod
    def _path_as_text(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None, **kwargs: Any
    ) -> list[Document]:
        if kwargs:
            raise TypeError(f"unsupported option(s) {', '.join(sorted(kwargs))}; supported: k")
        corpus = get_corpus(self.corpus_dir, config=get_settings())
        chunks = corpus.search(query, self.k if k is None else k)
        return [chunk_document(c) for c in chunks]


def chunk_document(chunk: RetrievedChunk) -> Document:
    """A stored chunk as a LangChain ``Document`` (id and ``metadata["chunk_id"]`` = chunk id)."""
    metadata = {**chunk.metadata, "chunk_id": chunk.chunk_id, "title": chunk.title, "score": chunk.score}
    return Document(id=chunk.chunk_id, page_content=chunk.text, metadata=metadata)
