"""``CacheBlendVectorStore``: a LangChain vector store whose documents' chunk KV is precomputed for
:class:`~langchain_cacheblend.ChatCacheBlend` and :class:`~langchain_cacheblend.CacheBlendLLM`."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Unpack

import numpy as np
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore
from langchain_core.vectorstores.utils import maximal_marginal_relevance

from cacheblend_rag.check import CheckReport
from cacheblend_rag.corpus import DocumentHit, ExternalEmbedder
from cacheblend_rag.corpus.embedder import identity_of_folder
from cacheblend_rag.engine.session import Session
from cacheblend_rag.frontend import CollectionOptions, DocumentCollection
from cacheblend_rag.settings import get_settings

# what LangChain's indexing API passes along with the documents; a corpus writes in one transaction
_IGNORED_OPTIONS = frozenset({"batch_size"})


class CacheBlendVectorStore(VectorStore):
    """Your documents in a cacheblend-rag corpus directory, searchable like any LangChain vector store,
    with each chunk's KV precomputed so a chat model over the same directory reuses it.

    ``corpus_dir`` may be empty or missing: it becomes a corpus. Documents are stored under their ids
    (given, ``Document.id``, or generated) and cut into token-exact chunks of at most ``chunk_tokens`` of
    the model's tokens; a split that fits stays one chunk, its text unchanged. Searches return the stored
    chunk's exact text with the document's id and metadata, so
    ``ChatCacheBlend(corpus_dir=...)`` recognises it in any prompt (no special chain needed) and reports
    the reused tokens in ``usage_metadata["input_token_details"]["cache_read"]``.

    ``embedding``: any LangChain ``Embeddings`` (recorded by name and dimension, and by a digest of its
    weights when it reads a local folder; reopening the corpus needs the same model again), or None for
    cacheblend-rag's default sentence embedder (offline; a corpus built by ``cacheblend-rag ingest``
    opens this way, wherever the virtual environment holding the model is now). Scores are cosine
    similarities. ``filter=`` takes ``{"key": value}``, ``{"key": {"$in": [...]}}`` and the other
    operators of :mod:`cacheblend_rag.corpus.filters`, applied inside the search. ``precompute_kv=False``
    computes chunk KV on first use instead of when documents are added. ``close()`` gives back the
    shared model.

    Example:
        .. code-block:: python

            store = CacheBlendVectorStore.from_documents(splits, corpus_dir="my-corpus")
            retriever = store.as_retriever(search_kwargs={"k": 4})
            chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | (
                ChatCacheBlend(corpus_dir="my-corpus")
            )
    """

    def __init__(
        self,
        corpus_dir: str | os.PathLike[str],
        embedding: Embeddings | None = None,
        *,
        embedding_name: str | None = None,
        **options: Unpack[CollectionOptions],
    ) -> None:
        """``options``: ``model``, ``chunk_tokens``, ``index_type``, ``precompute_kv`` (see
        :class:`~cacheblend_rag.frontend.DocumentCollection`)."""
        self._embedding = embedding
        embedder = None
        if embedding is not None:
            name, sha = embedding_name or embeddings_name(embedding), ""
            folder = _local_folder(embedding) if embedding_name is None else None
            if folder is not None:  # recorded by its weights, not its path (see ExternalEmbedder)
                name, sha = identity_of_folder(
                    f"{type(embedding).__module__}.{type(embedding).__qualname__}", folder
                )
            embedder = ExternalEmbedder(name, embedding.embed_documents, embedding.embed_query, sha256=sha)
        self._documents = DocumentCollection(corpus_dir, embedder, config=get_settings(), **options)

    @property
    def embeddings(self) -> Embeddings | None:
        """The ``Embeddings`` given (None: the default sentence embedder)."""
        return self._embedding

    @property
    def corpus_dir(self) -> Path:
        return self._documents.corpus_dir

    @property
    def collection(self) -> DocumentCollection:
        """The corpus behind the store (its documents, corpus and shared engine)."""
        return self._documents

    @property
    def session(self) -> Session:
        """The corpus and the shared engine over it, as every LLM over the corpus holds them (the engine
        is loaded on first use)."""
        return self._documents.session

    def close(self) -> None:
        """Give back the store's hold on the shared model (the last holder frees it)."""
        self._documents.close()

    # -- writing -------------------------------------------------------------------------------------

    def add_texts(
        self,
        texts: Iterable[str],
        metadatas: list[dict[str, Any]] | None = None,
        *,
        ids: list[str] | None = None,
        **kwargs: Any,
    ) -> list[str]:
        """Add (or replace, by id) texts; returns their ids. Missing ids are generated (uuid4)."""
        _check_options(kwargs, _IGNORED_OPTIONS)
        texts = list(texts)
        if metadatas is not None and len(metadatas) != len(texts):
            raise ValueError(f"got {len(metadatas)} metadatas for {len(texts)} texts")
        if ids is not None and len(ids) != len(texts):
            raise ValueError(f"got {len(ids)} ids for {len(texts)} texts")
        given = ids if ids is not None else [None] * len(texts)
        keys = [i if i else str(uuid.uuid4()) for i in given]
        if texts:
            self._documents.add(texts, keys, metadatas)
        return keys

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool:
        """Delete documents by id (all of them when ``ids`` is None); unknown ids are ignored. The chunks
        no other document holds go with them: rows, vectors and KV."""
        _check_options(kwargs)
        self._documents.delete(self._documents.ids() if ids is None else ids)
        return True

    # -- reading -------------------------------------------------------------------------------------

    def check(self, questions: Sequence[str] | None = None, **options: Any) -> CheckReport:
        """Full prefill against KV reuse on this store's documents: see ``CacheBlendRAG.check`` (the
        options: ratios, method, target_agreement, max_tokens, sample, top_k)."""
        return self._documents.check(questions, **options)

    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        """The documents with these ids, as added; unknown ids are left out."""
        return [
            Document(id=doc.key, page_content=doc.text, metadata=dict(doc.metadata))
            for doc in self._documents.get(ids)
        ]

    def similarity_search(
        self, query: str, k: int = 4, filter: dict[str, Any] | None = None, **kwargs: Any
    ) -> list[Document]:
        return [doc for doc, _ in self.similarity_search_with_score(query, k, filter, **kwargs)]

    def similarity_search_with_score(
        self, query: str, k: int = 4, filter: dict[str, Any] | None = None, **kwargs: Any
    ) -> list[tuple[Document, float]]:
        """The ``k`` chunks most similar to ``query`` among documents matching ``filter``, with their
        cosine similarity, best first."""
        _check_options(kwargs)
        return [(_document(hit), hit.score) for hit in self._documents.search(query, k, filter)]

    def similarity_search_by_vector(
        self, embedding: list[float], k: int = 4, filter: dict[str, Any] | None = None, **kwargs: Any
    ) -> list[Document]:
        _check_options(kwargs)
        return [_document(hit) for hit in self._documents.search(embedding, k, filter)]

    def max_marginal_relevance_search(
        self,
        query: str,
        k: int = 4,
        fetch_k: int = 20,
        lambda_mult: float = 0.5,
        filter: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        """``k`` of the ``fetch_k`` chunks nearest to ``query`` (among documents matching ``filter``),
        chosen for relevance and diversity (``lambda_mult``: 1 relevance only, 0 diversity only)."""
        _check_options(kwargs)
        return self.max_marginal_relevance_search_by_vector(
            self._documents.corpus.documents.query_vector(query).tolist(), k, fetch_k, lambda_mult, filter
        )

    def max_marginal_relevance_search_by_vector(
        self,
        embedding: list[float],
        k: int = 4,
        fetch_k: int = 20,
        lambda_mult: float = 0.5,
        filter: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        _check_options(kwargs)
        hits = self._documents.search(embedding, max(k, fetch_k), filter)
        if not hits:
            return []
        documents = self._documents.corpus.documents
        vectors = documents.chunk_vectors([hit.chunk_id for hit in hits])
        chosen = maximal_marginal_relevance(
            np.asarray(documents.query_vector(embedding)), list(vectors), lambda_mult=lambda_mult, k=k
        )
        return [_document(hits[i]) for i in chosen]

    def _select_relevance_score_fn(self):
        return _cosine_to_relevance

    # -- construction --------------------------------------------------------------------------------

    @classmethod
    def from_texts(
        cls,
        texts: list[str],
        embedding: Embeddings | None = None,
        metadatas: list[dict[str, Any]] | None = None,
        *,
        ids: list[str] | None = None,
        corpus_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> CacheBlendVectorStore:
        """A store over ``corpus_dir`` (required) holding ``texts``; other keywords go to the constructor."""
        if corpus_dir is None:
            raise TypeError("CacheBlendVectorStore.from_texts needs corpus_dir=, the folder to keep it in")
        store = cls(corpus_dir, embedding, **kwargs)
        store.add_texts(texts, metadatas, ids=ids)
        return store

    @classmethod
    def from_documents(
        cls, documents: list[Document], embedding: Embeddings | None = None, **kwargs: Any
    ) -> CacheBlendVectorStore:
        """A store over ``corpus_dir=`` (required) holding ``documents``, under their ids when they have
        them."""
        return super().from_documents(documents, embedding, **kwargs)


def embeddings_name(embedding: Embeddings) -> str:
    """What identifies an ``Embeddings`` in a corpus's manifest: its class and, when it says, its model."""
    kind = type(embedding)
    name = f"{kind.__module__}.{kind.__qualname__}"
    for attribute in ("model", "model_name", "model_id"):
        value = getattr(embedding, attribute, None)
        if isinstance(value, str) and value:
            return f"{name}:{value}"
    return name


def _local_folder(embedding: Embeddings) -> Path | None:
    """The local folder an ``Embeddings`` reads its model from (``model_name`` or ``model`` naming a
    folder, as ``HuggingFaceEmbeddings`` does), or None."""
    for attribute in ("model_name", "model"):
        value = getattr(embedding, attribute, None)
        if isinstance(value, str) and value and Path(value).expanduser().is_dir():
            return Path(value).expanduser()
    return None


def _document(hit: DocumentHit) -> Document:
    return Document(id=hit.key, page_content=hit.text, metadata=dict(hit.metadata))


def _cosine_to_relevance(score: float) -> float:
    """Cosine similarity in [-1, 1] as a relevance in [0, 1]."""
    return (1.0 + score) / 2.0


def _check_options(options: dict[str, Any], ignored: frozenset[str] = frozenset()) -> None:
    unknown = set(options) - ignored
    if unknown:
        raise TypeError(f"unsupported option(s) {', '.join(sorted(unknown))}")
