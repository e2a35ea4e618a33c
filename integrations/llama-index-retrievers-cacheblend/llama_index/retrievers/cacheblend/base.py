"""``CacheBlendRetriever``: LlamaIndex retriever over an ingested cacheblend-rag corpus."""

from __future__ import annotations

import asyncio
from pathlib import Path

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.callbacks import CallbackManager
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from cacheblend_rag.corpus import RetrievedChunk
from cacheblend_rag.frontend import get_corpus
from cacheblend_rag.settings import get_settings


class CacheBlendRetriever(BaseRetriever):
    """Top-``similarity_top_k`` chunks of a corpus for a query.

    Each node's id is the chunk id and its text the chunk's text exactly as stored. The chunk's metadata
    (``title``, ``source``, offsets, ``score``) is kept on the node but hidden from the LLM and the
    embedder, so any synthesizer pastes the exact stored text and the LLM recognises it.
    """

    def __init__(
        self,
        corpus_dir: str | Path,
        similarity_top_k: int | None = None,
        callback_manager: CallbackManager | None = None,
        verbose: bool = False,
    ) -> None:
        top_k = get_settings().top_k if similarity_top_k is None else similarity_top_k
        if top_k < 1:
            raise ValueError(f"similarity_top_k must be at least 1, got {top_k}")
        self.corpus_dir = str(corpus_dir)
        self.similarity_top_k = top_k
        super().__init__(callback_manager=callback_manager, verbose=verbose)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        corpus = get_corpus(self.corpus_dir, config=get_settings())
        chunks = corpus.search(query_bundle.query_str, self.similarity_top_k)
        return [NodeWithScore(node=chunk_node(c), score=c.score) for c in chunks]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)


def chunk_node(chunk: RetrievedChunk) -> TextNode:
    """A stored chunk as a ``TextNode`` (id = chunk id, text = stored text, metadata hidden from the LLM)."""
    metadata = {**chunk.metadata, "chunk_id": chunk.chunk_id, "title": chunk.title}
    return TextNode(
        id_=chunk.chunk_id,
        text=chunk.text,
        metadata=metadata,
        excluded_llm_metadata_keys=list(metadata),
        excluded_embed_metadata_keys=list(metadata),
    )
