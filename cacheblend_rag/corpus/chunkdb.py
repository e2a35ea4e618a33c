"""The corpus on disk: ``corpus.sqlite`` (what the corpus holds; ``manifest.json``, what it was built
with, is :mod:`.manifest`'s). Writes are here, reads in :mod:`.chunkreads`.

Tables of ``corpus.sqlite``:

- ``files``: one row per ingested file (path, content hash, size, mtime).
- ``documents``: one row per document (a file, or a .jsonl record, or a text added through the API under
  the caller's id): key, title, metadata JSON.
- ``chunks``: one row per distinct chunk (content-identical chunks are stored once): chunk id, the text
  exactly as stored, a hash of the text (for exact text look-ups), token ids as a little-endian int32
  blob, token count, the embedding (float32 blob), the KV key and whether its KV is precomputed. The
  row id is the chunk's id in the FAISS index.
- ``doc_chunks``: where each chunk occurs: document, ordinal, character span.
- ``meta``: ``version`` (bumped by every change to the chunk set) and ``index_version`` (the version the
  saved FAISS index was built from), so a crash between a commit and the index write is detected.

Every query is parameterised; ids from callers are validated before they reach SQL.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import StoreError
from ..text.chunker import Chunk, pack_token_ids, unpack_token_ids
from ..text.document import Document
from .chunkreads import ChunkReads, ChunkRow, StoredDocument, _batches, text_hash
from .manifest import FORMAT_VERSION, MANIFEST_NAME, READABLE_FORMATS, CorpusManifest

# The manifest's names are importable from here too, where the corpus's other file names live.
__all__ = [
    "DB_NAME",
    "FAISS_INDEX_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "READABLE_FORMATS",
    "ChunkDB",
    "ChunkRow",
    "CorpusManifest",
    "FileChanges",
    "StoredDocument",
    "text_hash",
]

DB_NAME = "corpus.sqlite"
FAISS_INDEX_NAME = "faiss.index"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files (
    id INTEGER PRIMARY KEY,
    path TEXT NOT NULL UNIQUE,
    content_hash TEXT NOT NULL,
    size INTEGER NOT NULL,
    mtime REAL NOT NULL,
    ingested_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS documents (
    id INTEGER PRIMARY KEY,
    file_id INTEGER REFERENCES files(id) ON DELETE CASCADE,
    key TEXT NOT NULL UNIQUE,
    source TEXT,
    title TEXT,
    metadata TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY,
    chunk_id TEXT NOT NULL UNIQUE,
    text TEXT NOT NULL,
    text_hash TEXT NOT NULL,
    token_ids BLOB NOT NULL,
    n_tokens INTEGER NOT NULL,
    retokenizes INTEGER NOT NULL,
    embedding BLOB NOT NULL,
    kv_key TEXT NOT NULL,
    kv_ready INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS chunks_by_text ON chunks(text_hash);
CREATE INDEX IF NOT EXISTS chunks_kv_pending ON chunks(kv_ready);
CREATE TABLE IF NOT EXISTS doc_chunks (
    doc_id INTEGER NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
    ordinal INTEGER NOT NULL,
    chunk_row INTEGER NOT NULL REFERENCES chunks(id),
    start INTEGER NOT NULL,
    end INTEGER NOT NULL,
    PRIMARY KEY (doc_id, ordinal)
);
CREATE INDEX IF NOT EXISTS doc_chunks_by_chunk ON doc_chunks(chunk_row);
"""


@dataclass
class FileChanges:
    """What a change of documents (a file's, or some by key) did to the chunk set."""

    chunks: int = 0  # chunk occurrences written
    tokens: int = 0
    new_chunks: list[str] = field(default_factory=list)
    removed_chunks: list[str] = field(default_factory=list)
    removed_kv_keys: list[str] = field(default_factory=list)
    removed_rows: list[int] = field(default_factory=list)  # the removed chunks' FAISS ids
    removed_documents: int = 0


class ChunkDB(ChunkReads):
    """Thread-safe access to ``corpus.sqlite`` (WAL mode: readers are not blocked by an ingest)."""

    def __init__(self, path: Path, readonly: bool = False) -> None:
        self.path = Path(path)
        self.readonly = readonly
        uri = f"file:{self.path}?mode=ro" if readonly else f"file:{self.path}"
        try:
            self._conn = sqlite3.connect(
                uri, uri=True, check_same_thread=False, timeout=60, isolation_level=None
            )
            self._conn.execute("PRAGMA foreign_keys = ON")
            if readonly:
                self._conn = self._readable(self._conn)
            else:
                self._conn.execute("PRAGMA journal_mode = WAL")
                # WAL + NORMAL: every commit survives a process crash (kill -9); only power loss can undo one
                self._conn.execute("PRAGMA synchronous = NORMAL")
                self._conn.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path}: cannot open chunk database: {exc}") from exc
        self._lock = threading.RLock()
        self.closed = False

    def _readable(self, conn: sqlite3.Connection) -> sqlite3.Connection:
        try:
            conn.execute("SELECT count(*) FROM meta").fetchone()
            return conn
        except sqlite3.OperationalError:
            # A WAL database in a folder nobody can write to (read-only mount or permissions): SQLite cannot
            # create the -shm file a plain read-only open needs, and no writer can exist, so reading the
            # database as immutable is exact.
            conn.close()
            uri = f"file:{self.path}?mode=ro&immutable=1"
            return sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=60, isolation_level=None)

    def close(self) -> None:
        with self._lock:
            self._conn.close()
            self.closed = True

    # --- versions -------------------------------------------------------------------------------------

    def _meta(self, key: str) -> int:
        row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return int(row[0]) if row else 0

    def version(self) -> int:
        with self._lock:
            return self._meta("version")

    def index_version(self) -> int:
        with self._lock:
            return self._meta("index_version")

    def set_index_version(self, version: int) -> None:
        with self._lock:
            self._conn.execute(
                "INSERT OR REPLACE INTO meta(key, value) VALUES ('index_version', ?)", (str(version),)
            )

    def _bump_version(self) -> int:
        version = self._meta("version") + 1
        self._conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('version', ?)", (str(version),))
        return version

    # --- writes ---------------------------------------------------------------------------------------

    def file_hash(self, path: str) -> str | None:
        with self._lock:
            row = self._conn.execute("SELECT content_hash FROM files WHERE path = ?", (path,)).fetchone()
            return row[0] if row else None

    def known_chunk_ids(self, chunk_ids: Sequence[str]) -> set[str]:
        found: set[str] = set()
        with self._lock:
            for batch in _batches(list(chunk_ids)):
                marks = ",".join("?" * len(batch))
                found.update(
                    r[0]
                    for r in self._conn.execute(
                        f"SELECT chunk_id FROM chunks WHERE chunk_id IN ({marks})", batch
                    )
                )
        return found

    def replace_documents(
        self,
        documents: Sequence[tuple[Document, Sequence[Chunk]]],
        embeddings: dict[str, np.ndarray],
        file: tuple[str, str, int, float] | None,
        chunk_key: Callable[[str], str],
    ) -> FileChanges:
        """In one transaction: drop the previous documents of ``file`` (path, hash, size, mtime) or with
        the same keys, insert ``documents`` with their chunks, delete chunks no document uses any more.

        ``embeddings`` must hold a vector for every chunk not stored yet; ``chunk_key(chunk_id)`` gives
        the KV store key recorded for a new chunk."""
        changes = FileChanges()
        with self._lock, self._transaction():
            old_rows: set[int] = set()
            if file is not None:
                path, content_hash, size, mtime = file
                old_rows.update(
                    r[0]
                    for r in self._conn.execute(
                        "SELECT dc.chunk_row FROM doc_chunks dc JOIN documents d ON d.id = dc.doc_id "
                        "JOIN files f ON f.id = d.file_id WHERE f.path = ?",
                        (path,),
                    )
                )
                self._conn.execute("DELETE FROM files WHERE path = ?", (path,))  # cascades to its documents
                file_id = self._conn.execute(
                    "INSERT INTO files(path, content_hash, size, mtime, ingested_at) VALUES (?, ?, ?, ?, ?)",
                    (path, content_hash, size, mtime, time.time()),
                ).lastrowid
            else:
                file_id = None
            for doc, chunks in documents:
                old_rows.update(
                    r[0]
                    for r in self._conn.execute(
                        "SELECT dc.chunk_row FROM doc_chunks dc JOIN documents d ON d.id = dc.doc_id "
                        "WHERE d.key = ?",
                        (doc.key,),
                    )
                )
                self._conn.execute("DELETE FROM documents WHERE key = ?", (doc.key,))
                doc_id = self._conn.execute(
                    "INSERT INTO documents(file_id, key, source, title, metadata) VALUES (?, ?, ?, ?, ?)",
                    (file_id, doc.key, doc.source, doc.title, json.dumps(doc.metadata, ensure_ascii=False)),
                ).lastrowid
                for ordinal, chunk in enumerate(chunks):
                    row = self._chunk_row(chunk, embeddings, chunk_key, changes)
                    self._conn.execute(
                        "INSERT INTO doc_chunks(doc_id, ordinal, chunk_row, start, end) "
                        "VALUES (?, ?, ?, ?, ?)",
                        (doc_id, ordinal, row, chunk.start, chunk.end),
                    )
                    changes.chunks += 1
                    changes.tokens += chunk.n_tokens
            self._drop_orphans(old_rows, changes)
            if changes.new_chunks or changes.removed_chunks:
                self._bump_version()
        return changes

    def delete_documents(self, keys: Sequence[str]) -> FileChanges:
        """In one transaction: remove the documents with these keys (absent ones are ignored) and the
        chunks no remaining document uses."""
        return self._delete(
            "SELECT d.id, dc.chunk_row FROM documents d LEFT JOIN doc_chunks dc ON dc.doc_id = d.id "
            "WHERE d.key IN",
            "DELETE FROM documents WHERE key IN",
            keys,
        )

    def delete_files(self, paths: Sequence[str]) -> FileChanges:
        """In one transaction: forget these ingested files, their documents and the chunks no remaining
        document uses."""
        return self._delete(
            "SELECT d.id, dc.chunk_row FROM files f JOIN documents d ON d.file_id = f.id "
            "LEFT JOIN doc_chunks dc ON dc.doc_id = d.id WHERE f.path IN",
            "DELETE FROM files WHERE path IN",  # cascades to their documents and occurrences
            paths,
        )

    def _delete(self, rows_sql: str, delete_sql: str, values: Sequence[str]) -> FileChanges:
        changes = FileChanges()
        with self._lock, self._transaction():
            documents: set[int] = set()
            old_rows: set[int] = set()
            for batch in _batches(list(dict.fromkeys(values))):
                marks = ",".join("?" * len(batch))
                for doc, row in self._conn.execute(f"{rows_sql} ({marks})", batch):
                    documents.add(doc)
                    if row is not None:
                        old_rows.add(row)
                self._conn.execute(f"{delete_sql} ({marks})", batch)
            changes.removed_documents = len(documents)
            self._drop_orphans(old_rows, changes)
            if changes.removed_chunks:
                self._bump_version()
        return changes

    def _drop_orphans(self, rows: set[int], changes: FileChanges) -> None:
        """Delete those of ``rows`` that no document uses any more, recording them in ``changes``."""
        for batch in _batches(sorted(rows)):
            marks = ",".join("?" * len(batch))
            orphans = self._conn.execute(
                f"SELECT id, chunk_id, kv_key FROM chunks WHERE id IN ({marks}) "
                "AND NOT EXISTS (SELECT 1 FROM doc_chunks dc WHERE dc.chunk_row = chunks.id)",
                batch,
            ).fetchall()
            if orphans:
                self._conn.executemany("DELETE FROM chunks WHERE id = ?", [(r[0],) for r in orphans])
                changes.removed_chunks.extend(r[1] for r in orphans)
                changes.removed_kv_keys.extend(r[2] for r in orphans)
                changes.removed_rows.extend(r[0] for r in orphans)

    def _chunk_row(
        self,
        chunk: Chunk,
        embeddings: dict[str, np.ndarray],
        chunk_key: Callable[[str], str],
        changes: FileChanges,
    ) -> int:
        chunk_id = chunk.chunk_id
        row = self._conn.execute("SELECT id FROM chunks WHERE chunk_id = ?", (chunk_id,)).fetchone()
        if row:
            return row[0]
        vector = embeddings.get(chunk_id)
        if vector is None:
            raise StoreError(f"no embedding computed for new chunk {chunk_id}")
        changes.new_chunks.append(chunk_id)
        return self._conn.execute(
            "INSERT INTO chunks(chunk_id, text, text_hash, token_ids, n_tokens, retokenizes, embedding, "
            "kv_key) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                chunk_id,
                chunk.text,
                text_hash(chunk.text),
                pack_token_ids(chunk.token_ids),
                chunk.n_tokens,
                int(chunk.retokenizes),
                np.asarray(vector, dtype="<f4").tobytes(),
                chunk_key(chunk_id),
            ),
        ).lastrowid

    def rekey_kv(self, chunk_key: Callable[[tuple[int, ...]], str]) -> list[str]:
        """Give every chunk the KV key ``chunk_key(token_ids)`` and mark its KV as not computed yet (a new
        chunk context changes every key); returns the old keys of chunks whose KV was ready."""
        with self._lock:
            rows = self._conn.execute("SELECT id, token_ids, kv_key, kv_ready FROM chunks").fetchall()
            with self._transaction():
                self._conn.executemany(
                    "UPDATE chunks SET kv_key = ?, kv_ready = 0 WHERE id = ?",
                    [(chunk_key(unpack_token_ids(ids)), row) for row, ids, _, _ in rows],
                )
            return [old for _, _, old, ready in rows if ready]

    def kv_rows(self) -> list[tuple[int, tuple[int, ...], str, bool]]:
        """(row id, token ids, KV key, whether its KV is stored) of every chunk."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, token_ids, kv_key, kv_ready FROM chunks ORDER BY id"
            ).fetchall()
        return [(row, unpack_token_ids(ids), key, bool(ready)) for row, ids, key, ready in rows]

    def set_kv_keys(self, keys: Sequence[tuple[int, str, bool]]) -> None:
        """Give chunks (row id, KV key, whether its KV is stored) in one transaction (``store recode``)."""
        with self._lock, self._transaction():
            self._conn.executemany(
                "UPDATE chunks SET kv_key = ?, kv_ready = ? WHERE id = ?",
                [(key, int(ready), row) for row, key, ready in keys],
            )

    def mark_kv_ready(self, chunk_id: str, kv_key: str) -> None:
        """Record that the KV store holds this chunk's KV under ``kv_key``."""
        with self._lock:
            self._conn.execute(
                "UPDATE chunks SET kv_ready = 1, kv_key = ? WHERE chunk_id = ?", (kv_key, chunk_id)
            )

    def _transaction(self):
        return _Transaction(self._conn)


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any exception (including KeyboardInterrupt)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def __enter__(self) -> None:
        self._conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        self._conn.execute("ROLLBACK" if exc_type else "COMMIT")
