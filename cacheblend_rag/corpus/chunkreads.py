"""Reads of ``corpus.sqlite`` (see :mod:`.chunkdb` for its tables): chunks by row, id or text, documents by
key, the chunk rows of documents matching a metadata filter, embeddings and counts.

:class:`ChunkReads` is the read half of :class:`~.chunkdb.ChunkDB`, which supplies the connection and lock.
Every query is parameterised.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..text.chunker import unpack_token_ids
from .filters import Filter, to_sql

_SQL_BATCH = 500  # ids per IN (...) query, well under SQLite's variable limit


def text_hash(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


@dataclass(frozen=True)
class ChunkRow:
    """A stored chunk with the context of its first occurrence."""

    row: int
    chunk_id: str
    text: str
    token_ids: tuple[int, ...]
    kv_key: str
    kv_ready: bool
    title: str | None
    metadata: dict[str, Any]


@dataclass(frozen=True)
class StoredDocument:
    """A document as stored: its key (the caller's id, or the file path), its text (its chunks' texts
    joined, which is exactly the text that was added), title, metadata and chunk ids in order."""

    key: str
    text: str
    title: str | None
    metadata: dict[str, Any]
    chunk_ids: tuple[str, ...]


@dataclass(frozen=True)
class Occurrence:
    """A chunk inside a document: the chunk's row and the document's key and metadata."""

    row: int
    key: str
    metadata: dict[str, Any]


class ChunkReads:
    """Read queries over ``corpus.sqlite``; the class using it provides ``_conn`` and ``_lock``."""

    _conn: sqlite3.Connection
    _lock: threading.RLock

    def embeddings(self, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(row ids [n] int64, vectors [n, dim] float32) of every chunk, for (re)building the index."""
        with self._lock:
            rows = self._conn.execute("SELECT id, embedding FROM chunks ORDER BY id").fetchall()
        return _vectors(rows, dim)

    def pending_kv(self) -> list[tuple[str, tuple[int, ...]]]:
        """(chunk id, token ids) of chunks whose KV is not precomputed yet."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT chunk_id, token_ids FROM chunks WHERE kv_ready = 0 ORDER BY id"
            ).fetchall()
        return [(r[0], unpack_token_ids(r[1])) for r in rows]

    def chunks_by_rows(self, rows: Sequence[int]) -> dict[int, ChunkRow]:
        return self._select("c.id", list(rows), lambda r: r.row)

    def chunks_by_ids(self, chunk_ids: Sequence[str]) -> dict[str, ChunkRow]:
        return self._select("c.chunk_id", list(chunk_ids), lambda r: r.chunk_id)

    def chunk_by_text(self, text: str) -> ChunkRow | None:
        with self._lock:
            rows = self._conn.execute(
                "SELECT id FROM chunks WHERE text_hash = ? ORDER BY retokenizes DESC, id", (text_hash(text),)
            ).fetchall()
        found = self.chunks_by_rows([r[0] for r in rows])
        return next((found[r[0]] for r in rows if r[0] in found and found[r[0]].text == text), None)

    def _select(self, column: str, keys: list, key_of) -> dict:
        out: dict = {}
        with self._lock:
            for batch in _batches(keys):
                marks = ",".join("?" * len(batch))
                # the first occurrence of each chunk (lowest document, then ordinal) gives title and metadata
                query = f"""
                    SELECT c.id, c.chunk_id, c.text, c.token_ids, c.kv_key, c.kv_ready,
                           d.title, d.metadata, d.key, d.source, dc.ordinal, dc.start, dc.end
                    FROM chunks c
                    LEFT JOIN doc_chunks dc ON dc.rowid = (
                        SELECT rowid FROM doc_chunks WHERE chunk_row = c.id ORDER BY doc_id, ordinal LIMIT 1)
                    LEFT JOIN documents d ON d.id = dc.doc_id
                    WHERE {column} IN ({marks})"""
                for r in self._conn.execute(query, batch):
                    metadata = json.loads(r[7]) if r[7] else {}
                    if r[8] is not None:
                        metadata.update(
                            {"doc_key": r[8], "source": r[9], "ordinal": r[10], "start": r[11], "end": r[12]}
                        )
                    row = ChunkRow(r[0], r[1], r[2], unpack_token_ids(r[3]), r[4], bool(r[5]), r[6], metadata)
                    out[key_of(row)] = row
        return out

    def counts(self) -> dict[str, int]:
        with self._lock:
            one = self._conn.execute
            return {
                "files": one("SELECT COUNT(*) FROM files").fetchone()[0],
                "documents": one("SELECT COUNT(*) FROM documents").fetchone()[0],
                "chunks": one("SELECT COUNT(*) FROM chunks").fetchone()[0],
                "tokens": one("SELECT COALESCE(SUM(n_tokens), 0) FROM chunks").fetchone()[0],
                "kv_ready": one("SELECT COUNT(*) FROM chunks WHERE kv_ready = 1").fetchone()[0],
                "occurrences": one("SELECT COUNT(*) FROM doc_chunks").fetchone()[0],
            }

    def iter_chunk_ids(self) -> Iterator[str]:
        with self._lock:
            rows = self._conn.execute("SELECT chunk_id FROM chunks ORDER BY id").fetchall()
        yield from (r[0] for r in rows)

    # --- documents ------------------------------------------------------------------------------------

    def documents_by_keys(self, keys: Sequence[str]) -> dict[str, StoredDocument]:
        """The stored documents with these keys (absent keys are left out)."""
        parts: dict[str, list] = {}
        with self._lock:
            for batch in _batches(list(dict.fromkeys(keys))):
                marks = ",".join("?" * len(batch))
                query = f"""
                    SELECT d.key, d.title, d.metadata, c.chunk_id, c.text
                    FROM documents d
                    LEFT JOIN doc_chunks dc ON dc.doc_id = d.id
                    LEFT JOIN chunks c ON c.id = dc.chunk_row
                    WHERE d.key IN ({marks}) ORDER BY d.id, dc.ordinal"""
                for key, title, metadata, chunk_id, text in self._conn.execute(query, batch):
                    entry = parts.setdefault(key, [title, json.loads(metadata or "{}"), [], []])
                    if chunk_id is not None:
                        entry[2].append(chunk_id)
                        entry[3].append(text)
        return {
            key: StoredDocument(key, "".join(texts), title, metadata, tuple(ids))
            for key, (title, metadata, ids, texts) in parts.items()
        }

    def document_keys(self, where: Filter | None = None) -> list[str]:
        """Keys of the documents whose metadata matches ``where`` (all without one), oldest first."""
        sql, params = to_sql(where, "d.metadata") if where is not None else ("1", [])
        with self._lock:
            rows = self._conn.execute(f"SELECT d.key FROM documents d WHERE {sql} ORDER BY d.id", params)
            return [r[0] for r in rows]

    def rows_matching(self, where: Filter) -> np.ndarray:
        """Chunk rows (FAISS ids) that occur in at least one document whose metadata matches ``where``."""
        sql, params = to_sql(where, "d.metadata")
        with self._lock:
            found = self._conn.execute(
                "SELECT DISTINCT dc.chunk_row FROM doc_chunks dc JOIN documents d ON d.id = dc.doc_id "
                f"WHERE {sql}",
                params,
            ).fetchall()
        return np.fromiter((r[0] for r in found), dtype=np.int64, count=len(found))

    def occurrences(self, rows: Sequence[int], where: Filter | None = None) -> list[Occurrence]:
        """Each (chunk row, document) pair for these rows, documents matching ``where`` only, in
        document order; a chunk repeated inside one document counts once."""
        sql, params = to_sql(where, "d.metadata") if where is not None else ("1", [])
        out: dict[tuple[int, str], Occurrence] = {}
        with self._lock:
            for batch in _batches(list(rows)):
                marks = ",".join("?" * len(batch))
                query = (
                    "SELECT dc.chunk_row, d.key, d.metadata FROM doc_chunks dc "
                    f"JOIN documents d ON d.id = dc.doc_id WHERE dc.chunk_row IN ({marks}) AND {sql} "
                    "ORDER BY d.id, dc.ordinal"
                )
                for row, key, metadata in self._conn.execute(query, [*batch, *params]):
                    out.setdefault((row, key), Occurrence(row, key, json.loads(metadata or "{}")))
        return list(out.values())

    def embeddings_of(self, rows: Sequence[int], dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(row ids, vectors) of the given chunk rows, for an exact search among a few of them."""
        found: list[tuple[int, bytes]] = []
        with self._lock:
            for batch in _batches(list(rows)):
                marks = ",".join("?" * len(batch))
                found.extend(
                    self._conn.execute(f"SELECT id, embedding FROM chunks WHERE id IN ({marks})", batch)
                )
        return _vectors(found, dim)

    def file_paths(self) -> list[str]:
        """Paths of the ingested files the corpus records."""
        with self._lock:
            return [r[0] for r in self._conn.execute("SELECT path FROM files ORDER BY id")]


def _vectors(rows: Sequence[tuple[int, bytes]], dim: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
    vectors = np.zeros((len(rows), dim), dtype=np.float32)
    for i, (_, blob) in enumerate(rows):
        vectors[i] = np.frombuffer(blob, dtype="<f4")
    return ids, vectors


def _batches(items: list) -> Iterator[list]:
    for i in range(0, len(items), _SQL_BATCH):
        yield items[i : i + _SQL_BATCH]
