"""A corpus's documents by key, the way a vector store manages them (:class:`DocumentSet`).

A document is added under the caller's id with its metadata and cut into token-exact chunks of at most the
corpus's ``chunk_tokens`` (a text that fits stays one chunk, its text unchanged). Content-identical chunks
are stored once, with the vector they were first added with, however many documents hold them.

- **put** adds or replaces documents (a key already stored is replaced in the same transaction);
- **delete** removes documents, and with them the chunks no other document holds: their rows, their
  vectors in the index and their KV in the KV store;
- **get** returns documents as added (text and metadata);
- **search** ranks chunks by cosine similarity among the documents whose metadata matches a filter: the
  filter picks the eligible chunk rows in SQL and the FAISS search only ever looks at those (nothing is
  filtered after the top k). A hit is a chunk of a document with the chunk's exact text, so a language
  model over the same corpus recognises it in a prompt and reuses its KV.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import InvalidQueryError, StoreError
from ..store.kvstore import KVStore
from ..text.chunker import Chunk, Chunker
from ..text.document import Document
from .chunkdb import ChunkDB, FileChanges, StoredDocument
from .embedder import EmbedderLike, unit_vectors
from .filters import Filter, parse_filter
from .manifest import CorpusManifest
from .vectors import CorpusVectors

API_SOURCE = "api"  # the ``source`` recorded for documents added by key rather than from a file
MAX_TOP_K = 1000


@dataclass(frozen=True)
class DocumentHit:
    """One search result: a chunk of a stored document, with the chunk's exact stored text (the whole
    document's text when it fits in one chunk), the document's key and metadata, and the cosine
    similarity of the chunk to the query."""

    key: str
    text: str
    metadata: dict[str, Any]
    score: float
    chunk_id: str


class DocumentOwner(Protocol):
    """What a :class:`DocumentSet` uses of the corpus that holds it (:class:`~.corpus.Corpus` is one; the
    corpus makes its document set, so the set names its needs rather than import the corpus)."""

    corpus_dir: Path
    manifest: CorpusManifest
    db: ChunkDB
    vectors: CorpusVectors

    @property
    def chunker(self) -> Chunker: ...

    @property
    def embedder(self) -> EmbedderLike: ...

    @property
    def kv_store(self) -> KVStore: ...

    def add_documents(
        self,
        documents: Sequence[tuple[Document, Sequence[Chunk]]],
        file: tuple[str, str, int, float] | None = None,
        on_embedded: Callable[[int], None] | None = None,
        vectors: Mapping[str, np.ndarray] | None = None,
    ) -> FileChanges: ...


class DocumentSet:
    """The documents of one :class:`~.corpus.Corpus`, by key. Thread-safe (shares the corpus's lock)."""

    def __init__(self, corpus: DocumentOwner, lock: threading.RLock) -> None:
        self.corpus = corpus
        self._lock = lock

    def put(
        self,
        texts: Sequence[str],
        keys: Sequence[str],
        metadatas: Sequence[Mapping[str, Any] | None] | None = None,
        vectors: Sequence[Sequence[float] | None] | None = None,
    ) -> FileChanges:
        """Add documents under ``keys``, replacing any stored under the same key, in one transaction.
        ``vectors``: a vector per document from the corpus's embedder, already computed (None entries,
        or no list, are embedded here chunk by chunk). When a key repeats, its last document wins. The KV
        of chunks a replaced document held and no document holds now is deleted (see :meth:`delete`)."""
        if isinstance(texts, str) or isinstance(keys, str):
            raise TypeError("put takes sequences of texts and keys, not single strings")
        count = len(texts)
        metadatas = list(metadatas) if metadatas is not None else [None] * count
        vectors = list(vectors) if vectors is not None else [None] * count
        if not len(keys) == len(metadatas) == len(vectors) == count:
            raise ValueError(
                f"got {count} texts, {len(keys)} keys, {len(metadatas)} metadatas and {len(vectors)} vectors"
            )
        chunker, dim = self.corpus.chunker, self.corpus.manifest.embedding_dim
        documents: dict[str, tuple[Document, list]] = {}
        given: dict[str, np.ndarray] = {}
        for text, key, metadata, vector in zip(texts, keys, metadatas, vectors, strict=True):
            doc = Document(
                _checked_text(key, text), API_SOURCE, _checked_key(key), None, _json_safe(key, metadata)
            )
            chunks = chunker.split(text)
            if not chunks:
                raise InvalidQueryError(f"document {key!r} has no text to store (it holds no tokens)")
            documents.pop(key, None)  # a repeated key: the last one wins, in its position
            documents[key] = (doc, chunks)
            if vector is not None:
                given[key] = unit_vectors([vector], 1, dim, f"the vector of document {key!r}")[0]
            else:
                given.pop(key, None)
        if not documents:
            return FileChanges()
        changes = self.corpus.add_documents(list(documents.values()), vectors=given)
        self.drop_kv(changes.removed_kv_keys)
        return changes

    def delete(self, keys: Sequence[str]) -> FileChanges:
        """Remove the documents with these keys (absent keys are ignored), and the chunks no other
        document holds with their vectors and KV (deleted through the corpus's KV store, which the engines
        over the corpus read, so their RAM tier forgets them too)."""
        if isinstance(keys, str):
            raise TypeError("delete takes a sequence of keys, not one string")
        return self._delete(lambda: self.corpus.db.delete_documents(list(keys)))

    def delete_files(self, paths: Sequence[str]) -> FileChanges:
        """Forget these ingested files with their documents (see :meth:`delete` for what goes with them)."""
        return self._delete(lambda: self.corpus.db.delete_files(list(paths)))

    def _delete(self, delete) -> FileChanges:
        with self._lock:
            if self.corpus.db.readonly:
                raise StoreError(f"store {self.corpus.corpus_dir} is read-only")
            before = self.corpus.db.version()
            changes = delete()
            self.corpus.vectors.follow(before, changes, {})
        self.drop_kv(changes.removed_kv_keys)
        return changes

    def drop_kv(self, kv_keys: Sequence[str]) -> int:
        """Delete the KV of chunks the corpus no longer holds from its KV store; returns the number of
        entries deleted."""
        if not kv_keys:
            return 0
        store = self.corpus.kv_store
        return sum(1 for key in kv_keys if store.delete(key))

    def get(self, keys: Sequence[str]) -> list[StoredDocument]:
        """The stored documents with these keys, in the order asked, each once; absent keys are left out."""
        if isinstance(keys, str):
            raise TypeError("get takes a sequence of keys, not one string")
        wanted = list(dict.fromkeys(k for k in keys if isinstance(k, str)))
        found = self.corpus.db.documents_by_keys(wanted)
        return [found[k] for k in wanted if k in found]

    def keys_where(self, where: Mapping[str, Any] | Filter | None = None) -> list[str]:
        """Keys of the documents whose metadata matches ``where`` (see :mod:`.filters`), oldest first."""
        return self.corpus.db.document_keys(parse_filter(where))

    def search(
        self,
        query: str | Sequence[float] | np.ndarray,
        k: int = 4,
        where: Mapping[str, Any] | Filter | None = None,
        whole_documents: bool = False,
    ) -> list[DocumentHit]:
        """The ``k`` chunks nearest to ``query`` (a text, embedded with the corpus's embedder, or a vector
        from it) among the documents whose metadata matches ``where``, best first; a chunk held by several
        matching documents is a hit for each of them. ``whole_documents``: the ``k`` nearest documents
        instead, each once with its whole text, scored by its nearest chunk."""
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_TOP_K:
            raise InvalidQueryError(f"k must be an integer between 1 and {MAX_TOP_K}, got {k!r}")
        condition = parse_filter(where)
        vector = self.query_vector(query)
        rows = self.corpus.db.rows_matching(condition) if condition is not None else None
        eligible = len(rows) if rows is not None else self.corpus.db.counts()["chunks"]
        wanted = k
        while True:
            hits = self._chunk_hits(vector, wanted, rows, condition)
            if not whole_documents:
                return hits[:k]
            best: dict[str, DocumentHit] = {}
            for hit in hits:
                best.setdefault(hit.key, hit)
            if len(best) >= k or wanted >= eligible:
                break
            wanted = min(wanted * 4, eligible)  # a few documents own most nearby chunks: look further
        chosen = list(best.values())[:k]
        texts = {doc.key: doc.text for doc in self.get([hit.key for hit in chosen])}
        return [replace(hit, text=texts[hit.key]) for hit in chosen if hit.key in texts]

    def _chunk_hits(
        self, vector: np.ndarray, k: int, rows: np.ndarray | None, condition: Filter | None
    ) -> list[DocumentHit]:
        if rows is not None and len(rows) == 0:
            return []
        nearest = self.corpus.vectors.nearest(vector, k, rows)
        scores = dict(nearest)
        chunks = self.corpus.db.chunks_by_rows(list(scores))
        found = [o for o in self.corpus.db.occurrences(list(scores), condition) if o.row in chunks]
        rank = {row: i for i, (row, _) in enumerate(nearest)}
        found.sort(key=lambda o: rank[o.row])  # stable: document order among a chunk's documents
        return [
            DocumentHit(o.key, chunks[o.row].text, o.metadata, scores[o.row], chunks[o.row].chunk_id)
            for o in found
        ]

    def chunk_vectors(self, chunk_ids: Sequence[str]) -> np.ndarray:
        """The stored (unit-length) vectors of these chunks, in order: [len(chunk_ids), dim]."""
        rows = self.corpus.db.chunks_by_ids(list(chunk_ids))
        missing = [c for c in chunk_ids if c not in rows]
        if missing:
            raise InvalidQueryError(f"no chunk {missing[0]} in corpus {self.corpus.corpus_dir}")
        ids, vectors = self.corpus.db.embeddings_of(
            [rows[c].row for c in chunk_ids], self.corpus.manifest.embedding_dim
        )
        position = {int(row): i for i, row in enumerate(ids)}
        return vectors[[position[rows[c].row] for c in chunk_ids]]

    def query_vector(self, query: str | Sequence[float] | np.ndarray) -> np.ndarray:
        """``query`` as a unit vector: a text embedded with the corpus's embedder, or a vector checked."""
        if isinstance(query, str):
            if not query.strip():
                raise InvalidQueryError("the query is empty")
            return self.corpus.embedder.embed_query(query)
        dim = self.corpus.manifest.embedding_dim
        return unit_vectors([query], 1, dim, "the query vector")[0]


def _checked_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"a document key must be a non-empty string, got {key!r}")
    return key


def _checked_text(key: object, text: object) -> str:
    if not isinstance(text, str):
        raise TypeError(f"the text of document {key!r} must be a string, got {type(text).__name__}")
    return text


def _json_safe(key: str, metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """``metadata`` as stored (JSON), refusing what JSON cannot hold rather than changing it."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"the metadata of document {key!r} must be a dict, got {type(metadata).__name__}")
    if not all(isinstance(name, str) for name in metadata):
        raise ValueError(f"the metadata keys of document {key!r} must be strings")
    try:
        return json.loads(json.dumps(dict(metadata), ensure_ascii=False, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the metadata of document {key!r} cannot be stored as JSON: {exc}") from None
