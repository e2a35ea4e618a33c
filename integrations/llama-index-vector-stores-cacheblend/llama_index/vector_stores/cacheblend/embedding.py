"""``CacheBlendEmbedding``: cacheblend-rag's own sentence embedder (all-MiniLM-L6-v2, shipped with the
package, offline) as a LlamaIndex embed model, the one a corpus built by ``cacheblend-rag ingest`` was
embedded with."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import PrivateAttr

from cacheblend_rag.corpus import EmbedderLike, get_embedder


class CacheBlendEmbedding(BaseEmbedding):
    """A LlamaIndex embed model over a cacheblend-rag embedder: by default the package's sentence
    embedder (``model_name``: the ``embedder`` setting's model, ``all-MiniLM-L6-v2``), read from the
    folder its package ships, so nothing is downloaded and no API key is needed. Vectors are unit length,
    as the corpus stores them; texts longer than the model's window are embedded whole (the mean of their
    windows), as ``ingest`` embeds chunks.

    ``CacheBlendVectorStore(corpus_dir)`` without an ``embed_model`` uses one (its ``embed_model``
    property): pass that to ``VectorStoreIndex`` too."""

    _embedder: EmbedderLike = PrivateAttr()

    def __init__(
        self,
        model_name: str | os.PathLike[str] | None = None,
        *,
        embedder: EmbedderLike | None = None,
        **kwargs: Any,
    ) -> None:
        """``model_name``: the model's name or local folder (default: the default embedder);
        ``embedder``: an embedder already loaded instead (e.g. a corpus's)."""
        chosen = embedder if embedder is not None else get_embedder(model_name)
        kwargs.setdefault("embed_batch_size", 32)
        super().__init__(model_name=chosen.name, **kwargs)
        self._embedder = chosen

    @classmethod
    def class_name(cls) -> str:
        return "CacheBlendEmbedding"

    @property
    def embedder(self) -> EmbedderLike:
        """The cacheblend-rag embedder behind this model (what a corpus records and checks)."""
        return self._embedder

    def _get_query_embedding(self, query: str) -> Embedding:
        return self._embedder.embed_query(query).tolist()

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._embedder.embed([text])[0].tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return self._embedder.embed(texts).tolist()

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return await asyncio.to_thread(self._get_query_embedding, query)

    async def _aget_text_embedding(self, text: str) -> Embedding:
        return await asyncio.to_thread(self._get_text_embedding, text)

    async def _aget_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return await asyncio.to_thread(self._get_text_embeddings, texts)
