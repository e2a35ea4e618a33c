"""The KV store's SQLite index: one row per stored chunk (for the disk LRU, stats and verify) and the
models whose KV the store holds. WAL mode; opened read-only (immutable if need be) on a read-only disk."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from contextlib import closing
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..errors import StoreError
from ..models.runtime import ModelShape
from .fileformat import FileMeta

log = logging.getLogger(__name__)

KV_INDEX_NAME = "index.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    key TEXT PRIMARY KEY,
    model_fingerprint TEXT NOT NULL,
    kv_dtype TEXT NOT NULL,
    layout_version INTEGER NOT NULL,
    num_tokens INTEGER NOT NULL,
    size_bytes INTEGER NOT NULL,
    checksum TEXT NOT NULL,
    tier TEXT NOT NULL,
    created REAL NOT NULL,
    last_access REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS chunks_by_access ON chunks (last_access);
CREATE TABLE IF NOT EXISTS models (
    model_fingerprint TEXT NOT NULL,
    kv_dtype TEXT NOT NULL,
    shape TEXT NOT NULL,
    first_seen REAL NOT NULL,
    PRIMARY KEY (model_fingerprint, kv_dtype)
);
"""


class KVIndex:
    """The index of one store root. Thread-safe; ``read_only`` when the root or index is not writable."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / KV_INDEX_NAME
        self._lock = threading.Lock()
        writable = os.access(root, os.W_OK) and (not self.path.exists() or os.access(self.path, os.W_OK))
        self.read_only = not writable
        try:
            if self.read_only:
                if not self.path.is_file():
                    raise StoreError(f"the KV store directory {root} is read-only and holds no index")
                self._db = connect_read_only(self.path)
            else:
                db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
                db.execute("PRAGMA busy_timeout = 30000")
                db.execute("PRAGMA journal_mode = WAL")
                db.execute("PRAGMA synchronous = NORMAL")  # in WAL mode: consistent, no fsync per commit
                db.executescript(_SCHEMA)
                self._db = db
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the KV index {self.path}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def usage(self, fingerprint: str) -> dict[str, Any]:
        """The disk tier's entries and bytes (all models'), ``fingerprint``'s entries, and by codec that
        model's files: entries, bytes, tokens, file bytes per token."""
        (entries, size, models) = self.sql(
            "SELECT count(*), COALESCE(SUM(size_bytes), 0), count(DISTINCT model_fingerprint) FROM chunks"
        )[0]
        (mine,) = self.sql("SELECT count(*) FROM chunks WHERE model_fingerprint = ?", (fingerprint,))[0]
        by_codec = {
            codec: {
                "entries": n,
                "bytes": nbytes,
                "tokens": tokens,
                "bytes_per_token": nbytes / max(tokens, 1),
            }
            for codec, n, nbytes, tokens in self.sql(
                "SELECT kv_dtype, count(*), SUM(size_bytes), SUM(num_tokens) FROM chunks "
                "WHERE model_fingerprint = ? GROUP BY kv_dtype",
                (fingerprint,),
            )
        }
        return {
            "entries": entries,
            "entries_this_model": mine,
            "models": models,
            "bytes": size,
            "by_codec": by_codec,
        }

    def sql(self, query: str, params: Sequence[Any] = ()) -> list[tuple]:
        try:
            with self._lock:
                return self._db.execute(query, params).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"KV index {self.path}: {exc}") from exc

    def add_model(self, fingerprint: str, kv_dtype: str, shape: ModelShape) -> None:
        self.sql(
            "INSERT OR IGNORE INTO models VALUES (?, ?, ?, ?)",
            (fingerprint, kv_dtype, json.dumps(asdict(shape)), time.time()),
        )

    def record(self, key: str, meta: FileMeta, size: int) -> None:
        """Insert or refresh ``key``'s row (also used to index a valid file whose writer died before)."""
        now = time.time()
        row = (key, meta.model_fingerprint, meta.kv_dtype, meta.layout_version, meta.num_tokens, size)
        self.sql(
            "INSERT INTO chunks VALUES (?, ?, ?, ?, ?, ?, ?, 'disk', ?, ?) ON CONFLICT (key) DO UPDATE SET "
            "size_bytes = excluded.size_bytes, checksum = excluded.checksum, "
            "last_access = excluded.last_access",
            (*row, meta.checksum, now, now),
        )

    def forget(self, key: str) -> None:
        self.sql("DELETE FROM chunks WHERE key = ?", (key,))

    def touch(self, key: str, adopt: tuple[FileMeta, int] | None = None) -> None:
        """Record an access for disk LRU; index a valid file found without a row (its writer died)."""
        if self.read_only:
            return
        try:
            with self._lock:
                updated = self._db.execute(
                    "UPDATE chunks SET last_access = ? WHERE key = ?", (time.time(), key)
                )
            if updated.rowcount == 0 and adopt is not None:
                self.record(key, *adopt)
        except (sqlite3.Error, StoreError) as exc:  # an access time is not worth failing a read for
            log.debug("KV store %s: cannot record access of %s…: %s", self.root, key[:16], exc)

    def checksums(self) -> dict[str, str]:
        return dict(self.sql("SELECT key, checksum FROM chunks"))

    def total_bytes(self) -> int:
        (total,) = self.sql("SELECT COALESCE(SUM(size_bytes), 0) FROM chunks")[0]
        return total

    def by_last_access(self) -> list[tuple[str, int]]:
        """(key, size) of every row, least recently used first."""
        return self.sql("SELECT key, size_bytes FROM chunks ORDER BY last_access, created")


def stored_models(root: str | Path) -> list[tuple[str, str, ModelShape]]:
    """(fingerprint, kv dtype, shape) of every model whose KV the store at ``root`` holds."""
    index = Path(root) / KV_INDEX_NAME
    if not index.is_file():
        raise StoreError(f"no KV store at {root} (missing {KV_INDEX_NAME})")
    try:
        with closing(connect_read_only(index)) as db:
            rows = db.execute("SELECT model_fingerprint, kv_dtype, shape FROM models").fetchall()
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read the KV index {index}: {exc}") from exc
    return [(fingerprint, dtype, ModelShape(**json.loads(shape))) for fingerprint, dtype, shape in rows]


def stored_codec(root: str | Path, model_fingerprint: str, prefer: str) -> str | None:
    """The codec the store at ``root`` holds ``model_fingerprint``'s KV in (``prefer`` if it is one of
    several), or None when it holds none of it (or there is no store). What a corpus that does not record
    its codec (made before codecs) is read in, so a change of the default codec never orphans its KV."""
    if not (Path(root) / KV_INDEX_NAME).is_file():
        return None
    codecs = sorted(
        dtype for fingerprint, dtype, _ in stored_models(root) if fingerprint == model_fingerprint
    )
    if not codecs:
        return None
    return prefer if prefer in codecs else codecs[0]


def folder_codec(root: str | Path, model_fingerprint: str, requested: str | None, configured: str) -> str:
    """The codec an engine given the store folder ``root`` (not a corpus, which records its codec) keeps
    ``model_fingerprint``'s chunk KV in: ``requested`` if named, else the codec the folder already holds
    it in (``configured`` if several), else ``configured``. So a change of the default codec leaves a
    folder's KV hitting; ``store recode`` converts it."""
    if requested:
        return requested
    held = stored_codec(root, model_fingerprint, configured)
    if held is not None and held != configured:
        log.info("the KV store at %s holds this model's KV in %s: kept (not %s)", root, held, configured)
    return held or configured


def connect_read_only(index: Path) -> sqlite3.Connection:
    # A WAL database on a read-only file system may lack the -shm file SQLite needs for a plain
    # read-only open; nobody can write there, so opening it as immutable is exact.
    for suffix in ("mode=ro", "mode=ro&immutable=1"):
        db = sqlite3.connect(f"file:{index}?{suffix}", uri=True, timeout=30, check_same_thread=False)
        try:
            db.execute("SELECT count(*) FROM chunks").fetchone()
            return db
        except sqlite3.Error:
            db.close()
    raise StoreError(f"cannot open the read-only KV index {index}")
