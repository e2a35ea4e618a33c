"""A corpus directory opened for retrieval: ``Corpus.open(DIR).search(question)``; created from code with
``Corpus.create(DIR, model, embedder)``, its documents managed by key through ``corpus.documents``
(:mod:`.documents`).

Layout of DIR: ``manifest.json`` (:mod:`.manifest`) and ``corpus.sqlite`` (see :mod:`.chunkdb`),
``faiss.index`` (the vector index, rebuilt from the stored embeddings whenever it is missing or older than
the chunk set) and ``kv/`` (the chunk KV store, :attr:`Corpus.kv_store`: opened once per process by the
corpus, in the codec its manifest records, and handed to everything that reads or writes the corpus's
chunk KV: ingest, the engines built over the corpus, its document collection).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ..blend.segments import ChunkContext
from ..config import (
    DEFAULT_CHUNK_CONTEXT,
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_INDEX_TYPE,
    DEFAULT_KV_DTYPE,
    DEFAULT_TOP_K,
)
from ..errors import ChunkNotFoundError, InvalidQueryError, StoreError
from ..models.loader import read_shape
from ..models.runtime import ModelShape
from ..models.tokenizer import ModelTokenizer, load_model_tokenizer
from ..store.index import KV_INDEX_NAME, stored_models
from ..store.kvstore import KVStore
from ..store.shared import KVStoreOptions, acquire_store, release_store
from ..text.chunker import Chunk, Chunker, validate_chunk_id
from ..text.document import Document
from . import index as vector_index
from .chunkdb import DB_NAME, ChunkDB, FileChanges
from .context import new_chunk_context, upgrade_format
from .documents import DocumentSet
from .embedder import EmbedderLike, embedder_sha256, get_embedder, loadable_name
from .manifest import (
    FORMAT_VERSION,
    KV_DIR_NAME,
    CorpusManifest,
    check_compatible,
    check_embedder,
    check_new_corpus_dir,
    legacy_codec,
    narrow_corpus_dir,
)
from .retrieved import (
    CorpusStats,
    RetrievedChunk,
    check_question,
    check_top_k,
    embedding_text,
    retrieved_chunk,
)
from .vectors import CorpusVectors

log = logging.getLogger(__name__)

# importable from here, where ingest has always found them
__all__ = ["Corpus", "CorpusStats", "RetrievedChunk", "check_compatible", "check_new_corpus_dir"]


_EMBED_BATCH = 64
_CORPUS_DIR_MODE = 0o750  # never world-writable: a corpus's content ends up inside prompts


class Corpus:
    """Chunks, embeddings and the vector index of one corpus directory. Thread-safe."""

    def __init__(
        self,
        corpus_dir: Path,
        manifest: CorpusManifest,
        db: ChunkDB,
        embedder: EmbedderLike | None = None,
        kv_options: KVStoreOptions | None = None,
    ):
        self.corpus_dir = corpus_dir
        self.manifest = manifest
        self.db = db
        self._embedder = embedder
        self._tokenizer: ModelTokenizer | None = None
        self._chunker: Chunker | None = None
        self._lock = threading.RLock()  # also guards the index and document changes (.vectors, .documents)
        self.vectors = CorpusVectors(corpus_dir, manifest, db, self._lock)
        self._kv_options = kv_options or KVStoreOptions()
        self._store: KVStore | None = None
        self._owns_store = True
        # KV keys of chunks whose KV an upgrade made stale (the KV store may delete them)
        self.stale_kv_keys: list[str] = []

    # --- opening --------------------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        corpus_dir: str | Path,
        embedder: EmbedderLike | None = None,
        kv_options: KVStoreOptions | None = None,
    ) -> Corpus:
        """Open an existing corpus directory. ``embedder``: the one it was built with (checked; needed
        only for a corpus built with an external embedder, see :meth:`use_embedder`). ``kv_options``: how
        its KV store is opened (tier budgets, remote tier; default: the store's defaults, no remote tier;
        the edges pass ``KVStoreOptions.of(settings)``)."""
        corpus_dir = Path(corpus_dir).expanduser()
        manifest = CorpusManifest.load(corpus_dir)
        if manifest is None:
            raise StoreError(
                f"{corpus_dir} is not a cacheblend-rag store (a corpus directory has a manifest.json); "
                f"build one with `cacheblend-rag ingest PATH... --corpus {corpus_dir}`, or from code with "
                "Corpus.create or a CacheBlendVectorStore (LangChain, LlamaIndex) over the directory"
            )
        if embedder is not None:
            check_embedder(corpus_dir, manifest, embedder)
        if not (corpus_dir / DB_NAME).is_file():
            raise StoreError(f"{corpus_dir}: {DB_NAME} is missing; re-ingest into a new store")
        readonly = not os.access(corpus_dir, os.W_OK)
        if manifest.format_version < FORMAT_VERSION:
            log.warning(
                "corpus %s was built before chunk contexts (format %d): its chunk KV was precomputed with "
                "each chunk alone, which blends less faithfully; run `cacheblend-rag ingest` on it again to "
                "rebuild its KV (docs/fusor.md)",
                corpus_dir,
                manifest.format_version,
            )
        db = ChunkDB(corpus_dir / DB_NAME, readonly=readonly)
        return cls(corpus_dir, manifest, db, embedder, kv_options)

    @classmethod
    def create(
        cls,
        corpus_dir: str | Path,
        model: ModelTokenizer,
        embedder: EmbedderLike,
        chunk_tokens: int | None = None,
        index_type: str | None = None,
        kv_options: KVStoreOptions | None = None,
        kv_store: KVStore | None = None,
        chunk_context: str = DEFAULT_CHUNK_CONTEXT,
    ) -> Corpus:
        """Open ``corpus_dir`` for writing, creating it if needed (an empty or missing folder becomes an
        empty corpus). Refuses (and changes nothing) when the corpus was built with another model,
        embedder (name or dimension) or chunk size; a new ``index_type`` is adopted. ``kv_options``: as
        for :meth:`open`, whose ``kv_dtype`` is also the codec of a new corpus; ``kv_store``: an open store
        to use as the corpus's (an engine's, given to ingest; it stays its owner's). A new corpus gets
        ``chunk_tokens`` and ``index_type`` (None: the defaults) and records the ``chunk_context`` ('neutral'
        or 'none') of ``model``."""
        corpus_dir = Path(corpus_dir).expanduser()
        codec = (kv_options.kv_dtype if kv_options is not None else None) or DEFAULT_KV_DTYPE
        context = new_chunk_context(model, chunk_context)
        if index_type is not None:
            vector_index.check_index_type(index_type)
        manifest = CorpusManifest.load(corpus_dir) if corpus_dir.is_dir() else None
        if manifest is not None:
            check_compatible(corpus_dir, manifest, model, embedder, chunk_tokens)
            if index_type is not None and index_type != manifest.index_type:
                manifest = replace(manifest, index_type=index_type)
                manifest.save(corpus_dir)
                log.info("corpus %s switches to a %s index", corpus_dir, index_type)
        else:
            check_new_corpus_dir(corpus_dir)
            try:
                corpus_dir.mkdir(parents=True, exist_ok=True, mode=_CORPUS_DIR_MODE)
            except OSError as exc:
                raise StoreError(f"cannot create corpus directory {corpus_dir}: {exc}") from exc
            narrow_corpus_dir(corpus_dir, _CORPUS_DIR_MODE)
            sizes = (chunk_tokens or DEFAULT_CHUNK_TOKENS, index_type or DEFAULT_INDEX_TYPE)
            sha = embedder_sha256(embedder)
            manifest = CorpusManifest.new(model, embedder, sha, *sizes, context.token_ids, codec)
            ChunkDB(corpus_dir / DB_NAME).close()
            manifest.save(corpus_dir)  # last: a folder with a manifest is a complete, empty corpus
        corpus = cls(corpus_dir, manifest, ChunkDB(corpus_dir / DB_NAME), embedder, kv_options)
        corpus._tokenizer = model
        if kv_store is not None:
            corpus._store, corpus._owns_store = kv_store, False
        if manifest.format_version < FORMAT_VERSION:
            corpus.manifest, corpus.stale_kv_keys = upgrade_format(
                corpus.db, corpus_dir, manifest, context, corpus.kv_store
            )
            corpus.vectors.manifest = corpus.manifest
        return corpus

    def close(self) -> None:
        """Save the index if in-memory additions are not on disk yet, close the database and give back the
        KV store (the last holder in the process closes it)."""
        with self._lock:
            self.vectors.save_if_changed()
            self.db.close()
            store, self._store = self._store, None
        if store is not None and self._owns_store:
            release_store(store)

    def __enter__(self) -> Corpus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def chunk_context(self) -> ChunkContext:
        """What this corpus's chunks are prefilled behind when their KV is precomputed (engines serving
        the corpus must use it: it is part of every chunk's KV key)."""
        return ChunkContext(self.manifest.chunk_context)

    @property
    def kv_dtype(self) -> str:
        """The codec this corpus's chunk KV is stored in (part of every KV key): the manifest's record,
        else (a corpus made before codecs were recorded) the codec its KV store holds (the one its KV
        options name, if it holds several), else those options' codec, else the default."""
        if self.manifest.kv_dtype:
            return self.manifest.kv_dtype
        return legacy_codec(self.kv_dir, self.manifest, self._kv_options.kv_dtype or DEFAULT_KV_DTYPE)

    @property
    def kv_dir(self) -> Path:
        """Root of this corpus's chunk KV store (see :attr:`kv_store`)."""
        return self.corpus_dir / KV_DIR_NAME

    @property
    def kv_store(self) -> KVStore:
        """The corpus's chunk KV store, opened on first use in the codec of :attr:`kv_dtype` and shared with
        every other holder of it in the process (another :class:`Corpus` over this directory, an engine
        given this folder); closed by :meth:`close`. What engines over the corpus are built with
        (``Engine(model, store=corpus.kv_store)``), and where every chunk's KV key comes from."""
        with self._lock:
            if self._store is None:
                self._store = acquire_store(
                    self.kv_dir,
                    self.manifest.model_fingerprint,
                    self._model_shape(),
                    self.kv_dtype,
                    **self._kv_options.store_kwargs(),
                )
            return self._store

    def chunk_key(self, token_ids: Sequence[int]) -> str:
        """The KV key of the chunk made of ``token_ids``, as the corpus's KV store makes it (its model,
        codec and the corpus's chunk context)."""
        return self.kv_store.chunk_key(token_ids, self.chunk_context.key)

    @property
    def model_source(self) -> str:
        """Where the corpus's model is loaded from: the folder it was built with, else its name."""
        return self.manifest.model_path if Path(self.manifest.model_path).is_dir() else self.manifest.model

    def _model_shape(self) -> ModelShape:
        """The model's dimensions for the KV store: as its index records them, else from the model's
        config (a store with no KV of the model yet)."""
        if (self.kv_dir / KV_INDEX_NAME).is_file():
            for fingerprint, _, shape in stored_models(self.kv_dir):
                if fingerprint == self.manifest.model_fingerprint:
                    return shape
        return read_shape(self._tokenizer.path if self._tokenizer is not None else self.model_source)

    @property
    def embedder(self) -> EmbedderLike:
        """The corpus's embedder: the one given, else the one the manifest names, loaded on first use (an
        external embedder cannot be loaded by name: the caller gives it, see :meth:`use_embedder`)."""
        with self._lock:
            if self._embedder is None:
                name = loadable_name(self.manifest.embedder)
                if name is None:
                    raise StoreError(
                        f"corpus {self.corpus_dir} was built with the external embedder "
                        f"{self.manifest.embedder} ({self.manifest.embedding_dim}-dim vectors): give it "
                        "again to embed text (a CacheBlendVectorStore's embeddings, or "
                        "Corpus.open(DIR, embedder=...))"
                    )
                embedder = get_embedder(name)
                check_embedder(self.corpus_dir, self.manifest, embedder)
                self._embedder = embedder
            return self._embedder

    @property
    def can_embed(self) -> bool:
        """Whether text can be embedded: an embedder was given, or the manifest's can be loaded by name."""
        return self._embedder is not None or loadable_name(self.manifest.embedder) is not None

    def use_embedder(self, embedder: EmbedderLike) -> None:
        """Embed with ``embedder`` from now on; it must be the one the corpus was built with (same name
        and dimension)."""
        check_embedder(self.corpus_dir, self.manifest, embedder)
        with self._lock:
            self._embedder = embedder

    @cached_property
    def documents(self) -> DocumentSet:
        """The corpus's documents by key: add or replace, delete (with their chunks' vectors and KV), get,
        search with metadata filters."""
        return DocumentSet(self, self._lock)

    @property
    def chunker(self) -> Chunker:
        """The corpus's chunker (loads the model's tokenizer, checking its fingerprint, on first use)."""
        with self._lock:
            if self._chunker is None:
                if self._tokenizer is None:
                    found = load_model_tokenizer(self.model_source)
                    check_compatible(self.corpus_dir, self.manifest, found, None, None)
                    self._tokenizer = found
                self._chunker = Chunker(self._tokenizer.tokenizer, self.manifest.chunk_tokens)
            return self._chunker

    # --- retrieval ------------------------------------------------------------------------------------

    def search(self, question: str, top_k: int | None = None) -> list[RetrievedChunk]:
        """The ``top_k`` chunks (None: the default) most similar to ``question`` (cosine of embeddings),
        best first."""
        check_question(question)
        top_k = check_top_k(DEFAULT_TOP_K if top_k is None else top_k)
        query = self.embedder.embed_query(question)
        with self._lock:
            hits = vector_index.search(self.vectors.current(), query, top_k)
        rows = self.db.chunks_by_rows([row for row, _ in hits])
        return [retrieved_chunk(rows[row], score) for row, score in hits if row in rows]

    def get_chunks(self, chunk_ids: Sequence[str]) -> list[RetrievedChunk]:
        """The chunks with these ids, in the given order. Malformed ids raise ``InvalidChunkIdError``,
        unknown ones ``ChunkNotFoundError``."""
        if isinstance(chunk_ids, str):
            chunk_ids = [chunk_ids]
        wanted = [validate_chunk_id(c) for c in chunk_ids]
        rows = self.db.chunks_by_ids(wanted)
        missing = [c for c in wanted if c not in rows]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ChunkNotFoundError(f"no chunk {shown} in corpus {self.corpus_dir}")
        return [retrieved_chunk(rows[c], math.nan) for c in wanted]

    def find_by_text(self, text: str) -> RetrievedChunk | None:
        """The stored chunk whose text is exactly ``text`` (hash look-up), or None."""
        if not isinstance(text, str) or not text:
            return None
        row = self.db.chunk_by_text(text)
        return retrieved_chunk(row, math.nan) if row else None

    def add_texts(
        self,
        texts: Sequence[str],
        titles: Sequence[str | None] | None = None,
        metadatas: Sequence[dict[str, Any] | None] | None = None,
    ) -> list[list[str]]:
        """Add texts that are not in the corpus yet; each becomes a document of its own, and a text already
        stored as a chunk is found, not duplicated. Returns, per text, the ids of its chunks (one id when
        the text fits in one chunk). The engine computes their KV on first use."""
        if isinstance(texts, str):
            raise TypeError("add_texts takes a sequence of texts, not one string")
        titles = list(titles) if titles is not None else [None] * len(texts)
        metadatas = list(metadatas) if metadatas is not None else [None] * len(texts)
        if not len(titles) == len(metadatas) == len(texts):
            raise ValueError("texts, titles and metadatas must have the same length")
        out: list[list[str]] = []
        new_docs: dict[str, tuple[Document, list[Chunk]]] = {}
        for text, title, metadata in zip(texts, titles, metadatas, strict=True):
            if not isinstance(text, str) or not text.strip():
                raise InvalidQueryError("cannot add an empty text")
            existing = self.find_by_text(text)
            if existing is not None:
                out.append([existing.chunk_id])
                continue
            key = "text:" + hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
            if key not in new_docs:
                new_docs[key] = (
                    Document(text, "api", key, title, dict(metadata or {})),
                    self.chunker.split(text),
                )
            out.append([c.chunk_id for c in new_docs[key][1]])
        if new_docs:
            self.add_documents(list(new_docs.values()))
        return out

    def add_documents(
        self,
        documents: Sequence[tuple[Document, Sequence[Chunk]]],
        file: tuple[str, str, int, float] | None = None,
        on_embedded: Callable[[int], None] | None = None,
        vectors: Mapping[str, np.ndarray] | None = None,
    ) -> FileChanges:
        """Store chunked documents in one transaction, replacing earlier versions of the same ``file``
        (path, content hash, size, mtime) or of the same document keys. Only chunks not stored yet are
        embedded (``on_embedded(n)`` after each batch of n), unless ``vectors`` gives their document's
        vector (document key -> unit vector from the corpus's embedder, computed by the caller)."""
        with self._lock:
            if self.db.readonly:
                raise StoreError(f"store {self.corpus_dir} is read-only")
            first: dict[str, tuple[Document, Chunk]] = {}
            for doc, chunks in documents:
                for chunk in chunks:
                    first.setdefault(chunk.chunk_id, (doc, chunk))
            known = self.db.known_chunk_ids(list(first))
            given = vectors or {}
            fresh = [cid for cid in first if cid not in known and first[cid][0].key not in given]
            new_vectors = {
                cid: given[doc.key]
                for cid, (doc, _) in first.items()
                if cid not in known and doc.key in given
            }
            for start in range(0, len(fresh), _EMBED_BATCH):
                batch = fresh[start : start + _EMBED_BATCH]
                embedded = self.embedder.embed([embedding_text(*first[cid]) for cid in batch])
                new_vectors.update(zip(batch, embedded, strict=True))
                if on_embedded is not None:
                    on_embedded(len(batch))
            before = self.db.version()
            changes = self.db.replace_documents(
                documents,
                new_vectors,
                file,
                chunk_key=lambda cid: self.chunk_key(first[cid][1].token_ids),
            )
            self.vectors.follow(before, changes, new_vectors)
            return changes

    # --- the vector index (kept by .vectors) ----------------------------------------------------------

    def sync_index(self):
        """The FAISS index for the current chunk set (see :meth:`CorpusVectors.current`)."""
        return self.vectors.current()

    def rebuild_index(self) -> None:
        """Build the index afresh from the stored embeddings and save it (after a change of index type)."""
        self.vectors.rebuild()

    def save_index(self) -> None:
        """Make ``faiss.index`` on disk match the current chunk set."""
        self.vectors.save()

    # --- information ----------------------------------------------------------------------------------

    def stats(self) -> CorpusStats:
        """Counts of files, documents, chunks, tokens and precomputed KV, with the corpus's settings."""
        counts = self.db.counts()
        with self._lock:
            index_size = int(self.vectors.current().ntotal)
        return CorpusStats.of(str(self.corpus_dir), self.manifest, counts, index_size)
