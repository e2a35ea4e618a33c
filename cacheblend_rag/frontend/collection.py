"""A corpus directory as the backing of a vector store (what LangChain's and LlamaIndex's
``CacheBlendVectorStore`` wrap): :class:`DocumentCollection`.

An empty (or missing) directory becomes a corpus on first use, no CLI needed. Documents are added under the
caller's ids, replaced, deleted (their chunks' rows, vectors and KV with them), fetched and searched with
metadata filters (:mod:`cacheblend_rag.corpus.documents`). The chunk KV of added documents is precomputed
right away through the engine the process shares with every LLM over the same corpus, so the first
question already reuses it; with ``precompute_kv=False`` it is computed on first use instead.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict

from ..check import CheckReport
from ..config import DEFAULTS, Config
from ..corpus.chunkdb import FileChanges, StoredDocument
from ..corpus.corpus import Corpus
from ..corpus.documents import DocumentHit
from ..corpus.embedder import EmbedderLike, get_embedder
from ..corpus.filters import Filter
from ..corpus.manifest import CorpusManifest, check_compatible
from ..engine.session import Session
from ..errors import StoreError
from ..ingest.kv import precompute_pending
from ..models.tokenizer import load_model_tokenizer
from ..store.shared import KVStoreOptions
from .corpora import acquire_corpus, release_corpus
from .frontends import acquire_frontend, release_frontend
from .prompt_frontend import PromptFrontend


class CollectionOptions(TypedDict, total=False):
    """The options of a :class:`DocumentCollection` besides its folder and embedder, which the framework
    vector stores take as they are."""

    model: str | os.PathLike[str] | None
    chunk_tokens: int | None
    index_type: str | None
    precompute_kv: bool


def ensure_corpus(
    corpus_dir: Path,
    model: str | None = None,
    embedder: EmbedderLike | None = None,
    chunk_tokens: int | None = None,
    index_type: str | None = None,
    config: Config = DEFAULTS,
) -> None:
    """Make an empty or missing folder an empty corpus (for ``model``'s tokenizer, default:
    ``config.model``), as every integration object over a folder does (vector stores and LLMs alike); an
    existing corpus is checked against ``model`` and ``chunk_tokens`` when given. ``config``: the caller's
    settings (a new corpus's embedder, chunk size, index, codec and chunk context when not given)."""
    manifest = CorpusManifest.load(corpus_dir) if corpus_dir.is_dir() else None
    if manifest is None:
        tokenizer = load_model_tokenizer(model or config.model, config.home)
        Corpus.create(
            corpus_dir,
            tokenizer,
            embedder or get_embedder(config.embedder),
            chunk_tokens or config.chunk_tokens,
            index_type or config.index_type,
            kv_options=KVStoreOptions.of(config),
            chunk_context=config.chunk_context,
        ).close()
    elif model is not None or chunk_tokens is not None:
        found = load_model_tokenizer(model or config.model, config.home)
        check_compatible(corpus_dir, manifest, found, None, chunk_tokens)


class DocumentCollection:
    """Documents by id in one corpus directory, with their chunk KV kept ready for the LLMs reading it.

    ``embedder``: the caller's embedding model (an :class:`~cacheblend_rag.corpus.ExternalEmbedder`),
    recorded by name and dimension in a new corpus and required again, the same, to reopen it; None: our
    default sentence embedder (a corpus built by ``cacheblend-rag ingest`` is opened this way). ``model``:
    the LLM whose tokens chunks are cut into and whose KV is precomputed (default: the corpus's, else the
    settings' model); ``chunk_tokens`` and ``index_type`` apply to a new corpus (an existing one refuses
    another chunk size). ``config``: the caller's settings (see :func:`ensure_corpus`, and the engine's).
    Thread-safe.
    """

    def __init__(
        self,
        corpus_dir: str | os.PathLike[str],
        embedder: EmbedderLike | None = None,
        *,
        model: str | os.PathLike[str] | None = None,
        chunk_tokens: int | None = None,
        index_type: str | None = None,
        precompute_kv: bool = True,
        config: Config = DEFAULTS,
    ) -> None:
        self.config = config
        self.corpus_dir = Path(corpus_dir).expanduser()
        self.model = os.fspath(model) if model is not None else None
        self.precompute_kv = precompute_kv
        ensure_corpus(self.corpus_dir, self.model, embedder, chunk_tokens, index_type, config)
        self.corpus: Corpus = acquire_corpus(self.corpus_dir, embedder, config)  # released by close()
        self._holds_corpus = True
        if embedder is None and not self.corpus.can_embed:
            self._holds_corpus = False
            release_corpus(self.corpus)
            raise StoreError(
                f"corpus {self.corpus_dir} was built with the embedder {self.corpus.manifest.embedder} "
                f"({self.corpus.manifest.embedding_dim}-dim vectors): give the same embedding model again"
            )
        self._frontend: PromptFrontend | None = None
        self._lock = threading.Lock()

    # -- the engine that precomputes KV --------------------------------------------------------------

    @property
    def frontend(self) -> PromptFrontend:
        """The process's shared frontend (engine) over this corpus, acquired on first use."""
        with self._lock:
            if self._frontend is None or self._frontend.closed:
                self._frontend = acquire_frontend(self.corpus_dir, self.model, config=self.config)
            return self._frontend

    @property
    def session(self) -> Session:
        """The corpus and the shared engine over it, checked to belong together (the frontend's; the
        engine is loaded on first use)."""
        session = self.frontend.session
        assert session is not None  # a collection's frontend always reads its corpus
        return session

    def close(self) -> None:
        """Write the vector index if it changed (reopening then skips a rebuild) and give back the hold
        on the shared engine and the corpus (the last holder frees the model, and closes the corpus)."""
        with self._lock:
            frontend, self._frontend = self._frontend, None
            holds_corpus, self._holds_corpus = self._holds_corpus, False
        if holds_corpus and not self.corpus.db.readonly:
            self.corpus.save_index()
        if frontend is not None:
            release_frontend(frontend)
        if holds_corpus:
            release_corpus(self.corpus)

    # -- documents -----------------------------------------------------------------------------------

    def add(
        self,
        texts: Sequence[str],
        ids: Sequence[str],
        metadatas: Sequence[Mapping[str, Any] | None] | None = None,
        vectors: Sequence[Sequence[float] | None] | None = None,
    ) -> FileChanges:
        """Add (or replace, by id) documents; then precompute the KV of their new chunks, unless the
        collection computes KV lazily. The KV of chunks a replacement left unused is deleted. A text
        holding a NUL character is refused (ValueError), nothing of the batch stored."""
        _refuse_nul(texts, ids)
        changes = self.corpus.documents.put(texts, ids, metadatas, vectors)
        if self.precompute_kv and changes.new_chunks:
            precompute_pending(self.corpus, self.frontend.engine, only=changes.new_chunks)
        return changes

    def delete(self, ids: Sequence[str]) -> FileChanges:
        """Remove documents by id (unknown ids are ignored) with the rows, vectors and KV of the chunks no
        other document holds."""
        return self.corpus.documents.delete(ids)

    def get(self, ids: Sequence[str]) -> list[StoredDocument]:
        """Documents by id as added, in the order asked; unknown ids are left out."""
        return self.corpus.documents.get(ids)

    def ids(self, where: Mapping[str, Any] | Filter | None = None) -> list[str]:
        """Ids of the documents whose metadata matches ``where`` (all without it)."""
        return self.corpus.documents.keys_where(where)

    def check(self, questions: Sequence[str] | None = None, **options: Any) -> CheckReport:
        """:meth:`CacheBlendRAG.check <cacheblend_rag.rag.CacheBlendRAG.check>` on this corpus, through
        the process's shared engine over it (``options``: ratios, method, target_agreement,
        max_tokens, sample, top_k)."""
        rag = self.frontend.rag
        assert rag is not None  # a collection's frontend always reads its corpus
        return rag.check(questions, **options)

    def search(
        self,
        query: str | Sequence[float],
        k: int = 4,
        where: Mapping[str, Any] | Filter | None = None,
        whole_documents: bool = False,
    ) -> list[DocumentHit]:
        """The ``k`` chunks (or ``whole_documents``) nearest to ``query`` (text or vector) among the
        documents matching ``where``."""
        return self.corpus.documents.search(query, k, where, whole_documents)


def _refuse_nul(texts: Sequence[str], ids: Sequence[str]) -> None:
    """Refuse texts holding NUL (U+0000): binary read as text, never a document. The tokenizer and the
    prompt would carry it into the model's input unseen, and a chunk's text could no longer be found
    verbatim in a prompt, where C string handling on the way (a terminal, an HTTP client) cuts it short."""
    for position, text in enumerate(texts):
        if isinstance(text, str) and "\x00" in text:
            key = ids[position] if position < len(ids) else position
            raise ValueError(
                f"document {key!r} holds a NUL character (\\x00) at offset {text.index(chr(0))}: binary "
                "data is not a document; decode or clean the text before adding it"
            )
