"""A corpus directory opened for retrieval: ``Corpus.open(DIR).search(question)``.

Layout of DIR: ``manifest.json`` and ``corpus.sqlite`` (see :mod:`.chunkdb`), ``faiss.index`` (the vector
index, rebuilt from the stored embeddings whenever it is missing or older than the chunk set) and
``kv/`` (the chunk KV store, owned by :class:`cacheblend_rag.store.kvstore.KVStore`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from ..blend.segments import ChunkContext
from ..errors import ChunkNotFoundError, InvalidQueryError, StoreError
from ..models.tokenizer import ModelTokenizer, chunk_context_ids, load_model_tokenizer
from ..settings import get_settings
from ..store.keys import chunk_key
from ..text.chunker import Chunk, Chunker, validate_chunk_id
from ..text.document import Document
from . import index as vector_index
from .chunkdb import DB_NAME, FORMAT_VERSION, INDEX_NAME, ChunkDB, ChunkRow, CorpusManifest, FileChanges
from .embedder import Embedder, get_embedder

log = logging.getLogger(__name__)

KV_DIR_NAME = "kv"
_MAX_TOP_K = 1000
_EMBED_BATCH = 64
_CORPUS_DIR_MODE = 0o750  # never world-writable: a corpus's content ends up inside prompts


@dataclass(frozen=True)
class RetrievedChunk:
    """A chunk as retrieval returns it: stored text and token ids, similarity score, provenance."""

    chunk_id: str
    text: str
    token_ids: tuple[int, ...]
    score: float  # cosine similarity to the question; NaN when the chunk was fetched by id or text
    title: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    kv_key: str = ""

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class CorpusStats:
    """Counts and settings of a store."""

    corpus_dir: str
    model: str
    model_fingerprint: str
    embedder: str
    index_type: str
    chunk_tokens: int
    files: int
    documents: int
    chunks: int
    tokens: int
    kv_ready: int
    index_size: int


class Corpus:
    """Chunks, embeddings and the vector index of one corpus directory. Thread-safe."""

    def __init__(
        self, corpus_dir: Path, manifest: CorpusManifest, db: ChunkDB, embedder: Embedder | None = None
    ):
        self.corpus_dir = corpus_dir
        self.manifest = manifest
        self.db = db
        self._embedder = embedder
        self._tokenizer: ModelTokenizer | None = None
        self._chunker: Chunker | None = None
        self._index = None
        self._index_version = -1
        self._index_dirty = False  # in-memory index holds additions the saved one lacks
        self._lock = threading.RLock()
        # KV keys of chunks whose KV an upgrade made stale (the KV store may delete them)
        self.stale_kv_keys: list[str] = []

    # --- opening --------------------------------------------------------------------------------------

    @classmethod
    def open(cls, corpus_dir: str | Path, embedder: Embedder | None = None) -> Corpus:
        """Open an existing corpus directory (built by ``cacheblend-rag ingest``)."""
        corpus_dir = Path(corpus_dir).expanduser()
        manifest = CorpusManifest.load(corpus_dir)
        if manifest is None:
            raise StoreError(
                f"{corpus_dir} is not a cacheblend-rag store (a corpus directory has a manifest.json); "
                f"build one with `cacheblend-rag ingest PATH... --corpus {corpus_dir}`"
            )
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
        return cls(corpus_dir, manifest, ChunkDB(corpus_dir / DB_NAME, readonly=readonly), embedder)

    @classmethod
    def create(
        cls,
        corpus_dir: str | Path,
        model: ModelTokenizer,
        embedder: Embedder,
        chunk_tokens: int | None = None,
        index_type: str | None = None,
    ) -> Corpus:
        """Open ``corpus_dir`` for writing, creating it if needed. Refuses (and changes nothing) when the
        corpus was built with another model, embedder or chunk size; a new ``index_type`` is adopted."""
        corpus_dir = Path(corpus_dir).expanduser()
        if index_type is not None:
            vector_index.check_index_type(index_type)
        manifest = CorpusManifest.load(corpus_dir) if corpus_dir.is_dir() else None
        stale_kv: list[str] = []
        if manifest is not None:
            check_compatible(corpus_dir, manifest, model, embedder, chunk_tokens)
            if manifest.format_version < FORMAT_VERSION:
                manifest, stale_kv = _upgrade(corpus_dir, manifest, new_chunk_context(model))
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
            manifest = CorpusManifest(
                model=model.name,
                model_path=str(model.path),
                model_fingerprint=model.fingerprint,
                embedder=embedder.name,
                embedding_dim=embedder.dim,
                chunk_tokens=chunk_tokens or get_settings().chunk_tokens,
                index_type=index_type or get_settings().index_type,
                chunk_context=new_chunk_context(model).token_ids,
            )
            ChunkDB(corpus_dir / DB_NAME).close()
            manifest.save(corpus_dir)  # last: a folder with a manifest is a complete, empty corpus
        corpus = cls(corpus_dir, manifest, ChunkDB(corpus_dir / DB_NAME), embedder)
        corpus._tokenizer = model
        corpus.stale_kv_keys = stale_kv
        return corpus

    def close(self) -> None:
        """Save the index if in-memory additions are not on disk yet, then close the database."""
        with self._lock:
            if self._index_dirty and not self.db.readonly:
                self._save_index(self._index, self._index_version)
            self.db.close()

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
    def kv_dir(self) -> Path:
        """Root of this store's chunk KV store (``Engine(store=corpus.kv_dir)``)."""
        return self.corpus_dir / KV_DIR_NAME

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            self._embedder = get_embedder(self.manifest.embedder)
            if self._embedder.dim != self.manifest.embedding_dim:
                raise StoreError(
                    f"embedder {self.manifest.embedder} gives {self._embedder.dim}-dim vectors, "
                    f"the corpus holds {self.manifest.embedding_dim}-dim ones"
                )
        return self._embedder

    @property
    def chunker(self) -> Chunker:
        """The corpus's chunker (loads the model's tokenizer, checking its fingerprint, on first use)."""
        with self._lock:
            if self._chunker is None:
                if self._tokenizer is None:
                    where = self.manifest.model_path
                    found = load_model_tokenizer(where if Path(where).is_dir() else self.manifest.model)
                    check_compatible(self.corpus_dir, self.manifest, found, None, None)
                    self._tokenizer = found
                self._chunker = Chunker(self._tokenizer.tokenizer, self.manifest.chunk_tokens)
            return self._chunker

    # --- retrieval ------------------------------------------------------------------------------------

    def search(self, question: str, top_k: int | None = None) -> list[RetrievedChunk]:
        """The ``top_k`` chunks most similar to ``question`` (cosine of embeddings), best first."""
        if not isinstance(question, str) or not question.strip():
            raise InvalidQueryError("the question is empty")
        try:
            question.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidQueryError(
                f"the question is not valid Unicode: lone surrogate at character {exc.start}"
            ) from None
        top_k = get_settings().top_k if top_k is None else top_k
        if not isinstance(top_k, int) or not 1 <= top_k <= _MAX_TOP_K:
            raise InvalidQueryError(f"top_k must be an integer between 1 and {_MAX_TOP_K}, got {top_k!r}")
        query = self.embedder.embed_query(question)
        with self._lock:
            hits = vector_index.search(self.sync_index(), query, top_k)
        rows = self.db.chunks_by_rows([row for row, _ in hits])
        return [_retrieved(rows[row], score) for row, score in hits if row in rows]

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
        return [_retrieved(rows[c], math.nan) for c in wanted]

    def find_by_text(self, text: str) -> RetrievedChunk | None:
        """The stored chunk whose text is exactly ``text`` (hash look-up), or None."""
        if not isinstance(text, str) or not text:
            return None
        row = self.db.chunk_by_text(text)
        return _retrieved(row, math.nan) if row else None

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
    ) -> FileChanges:
        """Store chunked documents in one transaction, replacing earlier versions of the same ``file``
        (path, content hash, size, mtime) or of the same document keys. Only chunks not stored yet are
        embedded (``on_embedded(n)`` after each batch of n)."""
        with self._lock:
            if self.db.readonly:
                raise StoreError(f"store {self.corpus_dir} is read-only")
            first: dict[str, tuple[Document, Chunk]] = {}
            for doc, chunks in documents:
                for chunk in chunks:
                    first.setdefault(chunk.chunk_id, (doc, chunk))
            known = self.db.known_chunk_ids(list(first))
            fresh = [cid for cid in first if cid not in known]
            vectors: dict[str, np.ndarray] = {}
            for start in range(0, len(fresh), _EMBED_BATCH):
                batch = fresh[start : start + _EMBED_BATCH]
                embedded = self.embedder.embed([_embedding_text(*first[cid]) for cid in batch])
                vectors.update(zip(batch, embedded, strict=True))
                if on_embedded is not None:
                    on_embedded(len(batch))
            fingerprint, kv_dtype = self.manifest.model_fingerprint, get_settings().kv_dtype
            before = self.db.version()
            changes = self.db.replace_documents(
                documents,
                vectors,
                file,
                kv_key=lambda cid: chunk_key(
                    fingerprint, kv_dtype, first[cid][1].token_ids, self.chunk_context.key
                ),
            )
            after = self.db.version()
            # extend the loaded index in place when nothing else changed the corpus meanwhile
            appendable = self._index is not None and self._index_version == before and after == before + 1
            if appendable and not changes.removed_chunks and self.manifest.index_type != "ivf":
                rows = self.db.chunks_by_ids(changes.new_chunks)
                vector_index.add_vectors(
                    self._index,
                    np.stack([vectors[c] for c in changes.new_chunks]),
                    np.array([rows[c].row for c in changes.new_chunks], dtype=np.int64),
                )
                self._index_version = after
                self._index_dirty = True
            return changes

    # --- the vector index -----------------------------------------------------------------------------

    def sync_index(self):
        """The FAISS index for the current chunk set: the loaded one, the saved one if it is current, or
        one rebuilt from the stored embeddings (and saved, when the corpus is writable)."""
        with self._lock:
            version = self.db.version()
            if self._index is not None and self._index_version == version:
                return self._index
            index = None
            path = self.corpus_dir / INDEX_NAME
            if path.is_file() and self.db.index_version() == version:
                index = vector_index.read_index(path)
                if index.ntotal != self.db.counts()["chunks"]:
                    log.warning("%s does not match the chunk table; rebuilding it", path)
                    index = None
            if index is None:
                index = self._build_index()
                if not self.db.readonly:
                    self._save_index(index, version)
            self._index, self._index_version, self._index_dirty = index, version, False
            return index

    def rebuild_index(self) -> None:
        """Build the index afresh from the stored embeddings and save it (after a change of index type)."""
        with self._lock:
            version = self.db.version()
            index = self._build_index()
            self._save_index(index, version)
            self._index, self._index_version, self._index_dirty = index, version, False

    def save_index(self) -> None:
        """Make ``faiss.index`` on disk match the current chunk set."""
        with self._lock:
            index = self.sync_index()
            if self._index_dirty or self.db.index_version() != self._index_version:
                self._save_index(index, self._index_version)

    def _build_index(self):
        ids, vectors = self.db.embeddings(self.manifest.embedding_dim)
        return vector_index.build_index(vectors, ids, self.manifest.index_type, self.manifest.embedding_dim)

    def _save_index(self, index, version: int) -> None:
        # the lock keeps "write file, then record its version" atomic across processes
        with FileLock(str(self.corpus_dir / ".index.lock"), mode=0o644):
            if self.db.index_version() > version:
                return  # another process already saved a newer index
            vector_index.write_index(index, self.corpus_dir / INDEX_NAME)
            self.db.set_index_version(version)
        self._index_dirty = False

    # --- information ----------------------------------------------------------------------------------

    def stats(self) -> CorpusStats:
        """Counts of files, documents, chunks, tokens and precomputed KV, with the corpus's settings."""
        counts = self.db.counts()
        with self._lock:
            index_size = int(self.sync_index().ntotal)
        m = self.manifest
        return CorpusStats(
            corpus_dir=str(self.corpus_dir),
            model=m.model,
            model_fingerprint=m.model_fingerprint,
            embedder=m.embedder,
            index_type=m.index_type,
            chunk_tokens=m.chunk_tokens,
            files=counts["files"],
            documents=counts["documents"],
            chunks=counts["chunks"],
            tokens=counts["tokens"],
            kv_ready=counts["kv_ready"],
            index_size=index_size,
        )


def _retrieved(row: ChunkRow, score: float) -> RetrievedChunk:
    return RetrievedChunk(
        row.chunk_id, row.text, row.token_ids, score, row.title, dict(row.metadata), row.kv_key
    )


def _embedding_text(doc: Document, chunk: Chunk) -> str:
    # the title gives a chunk cut from the middle of a document the topic its own text may not name
    return f"{doc.title}\n{chunk.text}" if doc.title else chunk.text


def check_new_corpus_dir(corpus_dir: Path) -> None:
    """Refuse to turn a file, or a folder holding anything but hidden files and a KV store, into a store."""
    if corpus_dir.exists() and (
        not corpus_dir.is_dir()
        or any(not p.name.startswith(".") and p.name != KV_DIR_NAME for p in corpus_dir.iterdir())
    ):
        raise StoreError(
            f"{corpus_dir} exists and is neither an empty folder nor a cacheblend-rag store "
            "(a corpus directory)"
        )


def new_chunk_context(model: ModelTokenizer) -> ChunkContext:
    """The chunk context a corpus created now records (the ``chunk_context`` setting)."""
    return ChunkContext(chunk_context_ids(model.tokenizer, get_settings().chunk_context))


def _upgrade(
    corpus_dir: Path, manifest: CorpusManifest, context: ChunkContext
) -> tuple[CorpusManifest, list[str]]:
    """Bring a corpus of an older format to the current one: every chunk's KV key moves to ``context``
    and its KV is marked as not computed (ingest then precomputes it). Returns the new manifest and the
    now stale KV keys."""
    db = ChunkDB(corpus_dir / DB_NAME)
    try:
        kv_dtype = get_settings().kv_dtype
        stale = db.rekey_kv(lambda ids: chunk_key(manifest.model_fingerprint, kv_dtype, ids, context.key))
    finally:
        db.close()
    upgraded = replace(manifest, format_version=FORMAT_VERSION, chunk_context=context.token_ids)
    upgraded.save(corpus_dir)
    log.info(
        "corpus %s upgraded from format %d to %d: chunk KV is recomputed behind the %d-token chunk context",
        corpus_dir,
        manifest.format_version,
        FORMAT_VERSION,
        len(context),
    )
    return upgraded, stale


def check_compatible(
    corpus_dir: Path,
    manifest: CorpusManifest,
    model: ModelTokenizer,
    embedder: Embedder | None,
    chunk_tokens: int | None,
) -> None:
    """Raise StoreError unless ``model`` (and the embedder and chunk size, when given) match the store's."""
    if model.fingerprint != manifest.model_fingerprint:
        raise StoreError(
            f"corpus {corpus_dir} was built with model {manifest.model} (fingerprint "
            f"{manifest.model_fingerprint[:12]}…, at {manifest.model_path}); this run uses {model.name} "
            f"({model.fingerprint[:12]}…, at {model.path}). Use the same model or another corpus directory."
        )
    if embedder is not None and embedder.name != manifest.embedder:
        raise StoreError(
            f"corpus {corpus_dir} was built with embedder {manifest.embedder}, not {embedder.name}; "
            "use the same embedder or another corpus directory"
        )
    if chunk_tokens is not None and chunk_tokens != manifest.chunk_tokens:
        raise StoreError(
            f"corpus {corpus_dir} was built with {manifest.chunk_tokens}-token chunks, not {chunk_tokens}; "
            "use the same chunk size or another corpus directory"
        )
