"""The FAISS index of a corpus, kept in step with its chunk table (:class:`CorpusVectors`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from filelock import FileLock

from . import index as vector_index
from .chunkdb import FAISS_INDEX_NAME, ChunkDB, FileChanges
from .manifest import CorpusManifest

log = logging.getLogger(__name__)


class CorpusVectors:
    """A corpus's vector index: the loaded one while it matches the chunk set's version, else the saved
    ``faiss.index`` when that is current, else one rebuilt from the embeddings stored with the chunks.
    Changes made through the corpus are applied in place where the index type allows. Shares the
    corpus's lock."""

    def __init__(
        self, corpus_dir: Path, manifest: CorpusManifest, db: ChunkDB, lock: threading.RLock
    ) -> None:
        self.dir = corpus_dir
        self.manifest = manifest
        self.db = db
        self._lock = lock
        self._index = None
        self._version = -1
        self._dirty = False  # the in-memory index holds changes the saved one lacks

    def save_if_changed(self) -> None:
        """Write the in-memory index if it holds changes the saved one lacks (the corpus is closing)."""
        with self._lock:
            if self._dirty and not self.db.readonly:
                self._write(self._index, self._version)

    def nearest(
        self, query: np.ndarray, top_k: int, rows: np.ndarray | None = None
    ) -> list[tuple[int, float]]:
        """The ``top_k`` chunk rows nearest to the unit-length ``query`` vector as (row, cosine), best
        first. With ``rows``, the search is restricted to those rows inside the index (a filter applied
        before ranking); where an approximate index finds fewer than it should, they are ranked exactly."""
        with self._lock:
            hits = vector_index.search(self.current(), query, top_k, rows)
        if rows is not None and len(hits) < min(top_k, len(rows)):
            ids, vectors = self.db.embeddings_of(rows, self.manifest.embedding_dim)
            scores = vectors @ np.asarray(query, dtype=np.float32)
            order = np.argsort(-scores, kind="stable")[:top_k]
            hits = [(int(ids[i]), float(scores[i])) for i in order]
        return hits

    def follow(self, before: int, changes: FileChanges, vectors: Mapping[str, np.ndarray]) -> None:
        """Apply a committed change of the chunk set to the loaded index in place when nothing else
        changed the corpus meanwhile and the index type allows it (IVF takes no additions without
        retraining, HNSW no removals); otherwise the next search rebuilds it from the stored vectors."""
        after = self.db.version()
        current = self._index is not None and self._version == before and after == before + 1
        kind = self.manifest.index_type
        if not current or (changes.new_chunks and kind == "ivf") or (changes.removed_rows and kind == "hnsw"):
            return
        if changes.removed_rows:
            vector_index.remove_vectors(self._index, np.array(changes.removed_rows, dtype=np.int64))
        if changes.new_chunks:
            rows = self.db.chunks_by_ids(changes.new_chunks)
            vector_index.add_vectors(
                self._index,
                np.stack([vectors[c] for c in changes.new_chunks]),
                np.array([rows[c].row for c in changes.new_chunks], dtype=np.int64),
            )
        self._version = after
        self._dirty = True

    def current(self):
        """The FAISS index for the current chunk set: the loaded one, the saved one if it is current, or
        one rebuilt from the stored embeddings (and saved, when the corpus is writable)."""
        with self._lock:
            version = self.db.version()
            if self._index is not None and self._version == version:
                return self._index
            index = None
            path = self.dir / FAISS_INDEX_NAME
            if path.is_file() and self.db.index_version() == version:
                index = vector_index.read_index(path)
                if index.ntotal != self.db.counts()["chunks"]:
                    log.warning("%s does not match the chunk table; rebuilding it", path)
                    index = None
            if index is None:
                index = self._build()
                if not self.db.readonly:
                    self._write(index, version)
            self._index, self._version, self._dirty = index, version, False
            return index

    def rebuild(self) -> None:
        """Build the index afresh from the stored embeddings and save it (after a change of index type)."""
        with self._lock:
            version = self.db.version()
            index = self._build()
            self._write(index, version)
            self._index, self._version, self._dirty = index, version, False

    def save(self) -> None:
        """Make ``faiss.index`` on disk match the current chunk set."""
        with self._lock:
            index = self.current()
            if self._dirty or self.db.index_version() != self._version:
                self._write(index, self._version)

    def _build(self):
        ids, vectors = self.db.embeddings(self.manifest.embedding_dim)
        return vector_index.build_index(vectors, ids, self.manifest.index_type, self.manifest.embedding_dim)

    def _write(self, index, version: int) -> None:
        # the lock keeps "write file, then record its version" atomic across processes
        with FileLock(str(self.dir / ".index.lock"), mode=0o644):
            if self.db.index_version() > version:
                return  # another process already saved a newer index
            vector_index.write_index(index, self.dir / FAISS_INDEX_NAME)
            self.db.set_index_version(version)
        self._dirty = False
