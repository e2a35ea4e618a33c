"""The corpus on disk: ``manifest.json`` (what the corpus was built with) and ``corpus.sqlite``.

Tables of ``corpus.sqlite``:

- ``files``: one row per ingested file (path, content hash, size, mtime).
- ``documents``: one row per document (a file, or a .jsonl record, or a text added through the API):
  key, title, metadata JSON.
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

import hashlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import StoreError
from ..text.chunker import Chunk, pack_token_ids, unpack_token_ids
from ..text.document import Document

# 2: chunk KV is precomputed behind the chunk context the manifest records (part of each KV key).
# A format-1 corpus (chunks prefilled alone) is read as having no context, and upgraded by ingest.
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
MANIFEST_NAME = "manifest.json"
DB_NAME = "corpus.sqlite"
INDEX_NAME = "faiss.index"
_SQL_BATCH = 500  # ids per IN (...) query, well under SQLite's variable limit

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


def text_hash(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


@dataclass(frozen=True)
class CorpusManifest:
    """What a corpus directory was built with; it only accepts work from the same model and embedder."""

    model: str
    model_path: str
    model_fingerprint: str
    embedder: str
    embedding_dim: int
    chunk_tokens: int
    index_type: str
    format_version: int = FORMAT_VERSION
    created_at: float = field(default_factory=time.time)
    # token ids chunks are prefilled behind when their KV is precomputed (empty: alone)
    chunk_context: tuple[int, ...] = ()

    @classmethod
    def load(cls, corpus_dir: Path) -> CorpusManifest | None:
        """The manifest of ``corpus_dir``, or None when the folder holds none."""
        path = Path(corpus_dir) / MANIFEST_NAME
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            if raw.get("format_version") not in READABLE_FORMATS:
                raise StoreError(
                    f"{path}: corpus format {raw.get('format_version')!r} is not supported "
                    f"(this version reads formats {', '.join(map(str, READABLE_FORMATS))}); "
                    "rebuild the corpus"
                )
            fields = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
            fields["chunk_context"] = tuple(int(t) for t in fields.get("chunk_context", ()))
            return cls(**fields)
        except (ValueError, TypeError, KeyError) as exc:
            raise StoreError(f"{path}: unreadable manifest: {exc}") from exc

    def save(self, corpus_dir: Path) -> None:
        path = Path(corpus_dir) / MANIFEST_NAME
        tmp = path.with_name(f".{MANIFEST_NAME}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")
        tmp.chmod(0o644)  # never world-writable, whatever the umask
        os.replace(tmp, path)


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


@dataclass
class FileChanges:
    """What replacing one file's documents did to the chunk set."""

    chunks: int = 0  # chunk occurrences written
    tokens: int = 0
    new_chunks: list[str] = field(default_factory=list)
    removed_chunks: list[str] = field(default_factory=list)
    removed_kv_keys: list[str] = field(default_factory=list)


class ChunkDB:
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
        kv_key: Callable[[str], str],
    ) -> FileChanges:
        """In one transaction: drop the previous documents of ``file`` (path, hash, size, mtime) or with
        the same keys, insert ``documents`` with their chunks, delete chunks no document uses any more.

        ``embeddings`` must hold a vector for every chunk not stored yet; ``kv_key(chunk_id)`` gives the
        KV store key recorded for a new chunk."""
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
                    row = self._chunk_row(chunk, embeddings, kv_key, changes)
                    self._conn.execute(
                        "INSERT INTO doc_chunks(doc_id, ordinal, chunk_row, start, end) "
                        "VALUES (?, ?, ?, ?, ?)",
                        (doc_id, ordinal, row, chunk.start, chunk.end),
                    )
                    changes.chunks += 1
                    changes.tokens += chunk.n_tokens
            for batch in _batches(sorted(old_rows)):
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
            if changes.new_chunks or changes.removed_chunks:
                self._bump_version()
        return changes

    def _chunk_row(
        self,
        chunk: Chunk,
        embeddings: dict[str, np.ndarray],
        kv_key: Callable[[str], str],
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
                kv_key(chunk_id),
            ),
        ).lastrowid

    def rekey_kv(self, kv_key: Callable[[tuple[int, ...]], str]) -> list[str]:
        """Give every chunk the KV key ``kv_key(token_ids)`` and mark its KV as not computed yet (a new
        chunk context changes every key); returns the old keys of chunks whose KV was ready."""
        with self._lock:
            rows = self._conn.execute("SELECT id, token_ids, kv_key, kv_ready FROM chunks").fetchall()
            with self._transaction():
                self._conn.executemany(
                    "UPDATE chunks SET kv_key = ?, kv_ready = 0 WHERE id = ?",
                    [(kv_key(unpack_token_ids(ids)), row) for row, ids, _, _ in rows],
                )
            return [old for _, _, old, ready in rows if ready]

    def mark_kv_ready(self, chunk_id: str, kv_key: str) -> None:
        """Record that the KV store holds this chunk's KV under ``kv_key``."""
        with self._lock:
            self._conn.execute(
                "UPDATE chunks SET kv_ready = 1, kv_key = ? WHERE chunk_id = ?", (kv_key, chunk_id)
            )

    def _transaction(self):
        return _Transaction(self._conn)

    # --- reads ----------------------------------------------------------------------------------------

    def embeddings(self, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(row ids [n] int64, vectors [n, dim] float32) of every chunk, for (re)building the index."""
        with self._lock:
            rows = self._conn.execute("SELECT id, embedding FROM chunks ORDER BY id").fetchall()
        ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
        vectors = np.zeros((len(rows), dim), dtype=np.float32)
        for i, (_, blob) in enumerate(rows):
            vectors[i] = np.frombuffer(blob, dtype="<f4")
        return ids, vectors

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


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any exception (including KeyboardInterrupt)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def __enter__(self) -> None:
        self._conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        self._conn.execute("ROLLBACK" if exc_type else "COMMIT")


def _batches(items: list) -> Iterator[list]:
    for i in range(0, len(items), _SQL_BATCH):
        yield items[i : i + _SQL_BATCH]
