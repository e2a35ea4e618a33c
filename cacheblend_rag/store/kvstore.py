"""The chunk KV store: an LRU RAM tier (:mod:`.ram`) over a persistent disk tier (:mod:`.disk`), indexed
in SQLite (:mod:`.index`), files in the format of :mod:`.fileformat`.

Disk layout under the store root::

    index.sqlite                 key -> model, dtype, size, checksum, tier, created, last access (WAL mode)
    chunks/ab/<key>.safetensors  one file per chunk; tensors ``layers.<i>.keys`` / ``layers.<i>.values``
    locks/ab.lock                one lock file per key prefix (256 at most), held while a key is written

A read tries the RAM tier, then the disk; a write goes to both. Every file is self-describing and checked
(metadata on open, each layer's crc32 when it is read); a bad file is logged, removed and recomputed.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..blend.segments import ChunkKV, ChunkKVSource
from ..errors import StoreError
from ..models.runtime import ModelShape
from ..settings import get_settings
from . import maintenance
from .disk import LOCK_TIMEOUT_S, DiskChunkKV, DiskTier, make_dirs
from .fileformat import encode
from .index import INDEX_NAME, KVIndex, stored_models
from .keys import LAYOUT_VERSION, chunk_key, dtype_name, resolve_kv_dtype
from .maintenance import VerifyReport
from .ram import RamTier
from .tier import tier_of

log = logging.getLogger(__name__)

_KEY_CHARS = frozenset("0123456789abcdef")

__all__ = ["INDEX_NAME", "DiskChunkKV", "KVStore", "StoreCounters", "VerifyReport", "tier_of"]


@dataclass
class StoreCounters:
    """Hit/miss and I/O counters of one :class:`KVStore` instance (this process only)."""

    ram_hits: int = 0
    ram_misses: int = 0
    disk_hits: int = 0
    disk_misses: int = 0
    corrupt: int = 0
    puts: int = 0
    bytes_written: int = 0
    ram_evictions: int = 0
    disk_evictions: int = 0
    disk_bytes_read: int = 0
    # layers read from disk per key: a chunk shared by a batch should show num_layers, not a multiple
    disk_layer_reads: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["disk_layer_reads"] = dict(self.disk_layer_reads)
        return data


class KVStore:
    """Chunk KV of one model and storage dtype: RAM tier (LRU, byte budget) over disk files (LRU, budget).

    Safe for several threads and several processes on the same root. Returned sources implement
    :class:`ChunkKVSource`; their tensors are in the storage dtype and must not be modified in place.
    """

    def __init__(
        self,
        root: str | Path,
        model_fingerprint: str,
        shape: ModelShape,
        kv_dtype: torch.dtype | str | None = None,
        ram_budget_bytes: int | None = None,
        disk_budget_bytes: int | None = None,
        promote_on_read: bool = True,
    ) -> None:
        settings = get_settings()
        if not model_fingerprint:
            raise StoreError("KVStore needs the model fingerprint (LayerwiseModel.fingerprint)")
        self.root = Path(root)
        self.fingerprint = model_fingerprint
        self.shape = shape
        self.kv_dtype = resolve_kv_dtype(kv_dtype if kv_dtype is not None else settings.kv_dtype)
        self.kv_dtype_name = dtype_name(self.kv_dtype)
        disk_budget = settings.disk_budget_bytes if disk_budget_bytes is None else disk_budget_bytes
        ram_budget = settings.ram_budget_bytes if ram_budget_bytes is None else ram_budget_bytes
        if ram_budget < 0 or disk_budget < 0:
            raise ValueError("store byte budgets must be >= 0")
        self.promote_on_read = promote_on_read
        self.counters = StoreCounters()
        self._mutex = threading.Lock()
        self._writer: ThreadPoolExecutor | None = None
        try:
            make_dirs(self.root)
        except OSError as exc:
            if not self.root.is_dir():
                raise StoreError(f"cannot create the KV store directory {self.root}: {exc}") from exc
        self.index = KVIndex(self.root)
        self.ram = RamTier(ram_budget)
        self.disk = DiskTier(
            self.root,
            self.index,
            model_fingerprint,
            shape,
            self.kv_dtype,
            disk_budget,
            count=self._count,
            on_layer_read=self._count_layer_read,
            forget=self.ram.delete,
        )
        if not self.read_only:
            self.index.add_model(self.fingerprint, self.kv_dtype_name, shape)

    @property
    def read_only(self) -> bool:
        return self.index.read_only

    @property
    def disk_budget_bytes(self) -> int:
        return self.disk.budget_bytes

    @disk_budget_bytes.setter
    def disk_budget_bytes(self, value: int) -> None:  # takes effect at the next put or gc
        self.disk.budget_bytes = value

    # -- opening -------------------------------------------------------------------------------------

    @classmethod
    def open_existing(cls, root: str | Path, model_fingerprint: str | None = None, **kwargs: Any) -> KVStore:
        """Open a store that already exists, taking the model shape and dtype from its index.

        Without ``model_fingerprint`` the store must hold KV of exactly one model.
        """
        rows = stored_models(root)
        if model_fingerprint is not None:
            rows = [r for r in rows if r[0] == model_fingerprint]
        if not rows:
            wanted = f"model {model_fingerprint[:16]}…" if model_fingerprint else "any model"
            raise StoreError(f"the KV store at {root} holds no KV of {wanted}")
        if len({r[0] for r in rows}) > 1:
            raise StoreError(
                f"the KV store at {root} holds KV of several models ({', '.join(r[0][:12] for r in rows)}); "
                "name one with its fingerprint"
            )
        # one model may have been stored in several dtypes: prefer the configured one
        configured = dtype_name(get_settings().kv_dtype)
        fingerprint, kv_dtype, shape = next((r for r in rows if r[1] == configured), rows[0])
        kwargs.setdefault("kv_dtype", kv_dtype)
        return cls(root, fingerprint, shape, **kwargs)

    def close(self) -> None:
        """Wait for background writes and close the index."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        self.index.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- keys and paths ------------------------------------------------------------------------------

    def key_for(self, token_ids: Sequence[int], context: str = "") -> str:
        """The key of the chunk made of ``token_ids`` under this store's model and storage dtype,
        prefilled behind the chunk context whose ``ChunkContext.key`` is ``context``."""
        return chunk_key(self.fingerprint, self.kv_dtype, token_ids, context)

    def path_for(self, key: str) -> Path:
        """Where the disk tier keeps ``key``'s file."""
        _check_key(key)
        return self.disk.path_for(key)

    # -- reads ---------------------------------------------------------------------------------------

    def contains(self, key: str) -> bool:
        """Whether ``key`` is in RAM or has a file on disk (the file is checked only when read)."""
        _check_key(key)
        return self.ram.contains(key) or self.disk.contains(key)

    def get(self, key: str) -> ChunkKVSource | None:
        """The chunk's KV from the RAM tier, else from disk; None on a miss.

        A file that is truncated, corrupted or foreign is logged, removed and reported as a miss. A layer
        whose bytes fail their checksum raises :class:`CorruptKVError` when that layer is read.
        """
        _check_key(key)
        kv = self.ram.get(key)
        if kv is not None:
            self._count(ram_hits=1)
            self.index.touch(key)
            return kv
        self._count(ram_misses=1)
        limit = self.ram.budget if self.promote_on_read else -1
        return self.disk.get(key, self._promote, promote_max_bytes=limit)

    def get_many(self, keys: Sequence[str]) -> list[ChunkKVSource | None]:
        """:meth:`get` for each key; a key repeated in ``keys`` maps to the same source (read once)."""
        found: dict[str, ChunkKVSource | None] = {}
        for key in keys:
            if key not in found:
                found[key] = self.get(key)
        return [found[key] for key in keys]

    # -- writes --------------------------------------------------------------------------------------

    def put(self, key: str, kv: ChunkKV, ram: bool = True) -> int:
        """Store ``kv`` under ``key`` in the storage dtype, on disk (atomically) and in RAM.

        Returns the bytes written to disk: 0 when another writer had already stored a valid file.
        Raises StoreError when the store is read-only or the disk is full; nothing stored is changed.
        """
        _check_key(key)
        encoded = encode(key, kv, self.fingerprint, self.shape, self.kv_dtype)
        written = self.disk.write(key, encoded)
        if ram:
            self._count(ram_evictions=self.ram.put(key, encoded.kv))
        self._count(puts=1)
        return written

    def put_async(self, key: str, kv: ChunkKV) -> Future[int]:
        """:meth:`put` on a background thread (for write-back of chunks a request had to compute)."""
        with self._mutex:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-writer")
        future = self._writer.submit(self.put, key, kv)
        future.add_done_callback(_log_failed_put)
        return future

    def flush(self) -> None:
        """Wait until every :meth:`put_async` so far has finished."""
        with self._mutex:
            writer = self._writer
        if writer is not None:
            writer.submit(lambda: None).result()

    # -- removal -------------------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Remove ``key`` from both tiers. Returns whether anything was removed."""
        _check_key(key)
        self.disk.require_writable(f"delete chunk {key[:16]}…")
        in_ram = self.ram.delete(key)
        self.disk.drop_live(key)
        return self.disk.delete(key, LOCK_TIMEOUT_S) or in_ram

    def evict_ram(self, key: str | None = None) -> None:
        """Drop ``key`` (or everything) from the RAM tier only, so the next get reads the disk tier."""
        if key is None:
            self.ram.clear()
        else:
            self.ram.delete(key)
        self.disk.drop_live(key)

    def clear(self) -> int:
        """Remove every entry of every model in this root, in RAM and on disk. Returns files removed."""
        self.disk.require_writable("clear it")
        self.evict_ram()
        return self.disk.clear()

    # -- maintenance ---------------------------------------------------------------------------------

    def verify(self, repair: bool = False) -> VerifyReport:
        """Read and check every file (metadata, every layer's checksum) and the index (see
        :func:`.maintenance.verify`); with ``repair``, fix what was found."""
        return maintenance.verify(self.disk, repair)

    def gc(self) -> dict[str, int]:
        """Enforce the disk budget (LRU) and reconcile the index with the files (see
        :func:`.maintenance.gc`)."""
        return maintenance.gc(self.disk)

    # -- statistics ----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Entries and bytes per tier, budgets, and this process's counters."""
        (entries, size, models) = self.index.sql(
            "SELECT count(*), COALESCE(SUM(size_bytes), 0), count(DISTINCT model_fingerprint) FROM chunks"
        )[0]
        (mine,) = self.index.sql(
            "SELECT count(*) FROM chunks WHERE model_fingerprint = ?", (self.fingerprint,)
        )[0]
        return {
            "root": str(self.root),
            "model_fingerprint": self.fingerprint,
            "kv_dtype": self.kv_dtype_name,
            "layout_version": LAYOUT_VERSION,
            "read_only": self.read_only,
            "ram": {"entries": len(self.ram), "bytes": self.ram.bytes, "budget_bytes": self.ram.budget},
            "disk": {
                "entries": entries,
                "entries_this_model": mine,
                "models": models,
                "bytes": size,
                "budget_bytes": self.disk_budget_bytes,
            },
            "counters": self.counters.as_dict(),
        }

    def reset_counters(self) -> None:
        with self._mutex:
            self.counters = StoreCounters()

    def _count(self, **deltas: int) -> None:
        with self._mutex:
            for name, delta in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)

    def _count_layer_read(self, key: str, nbytes: int) -> None:
        with self._mutex:
            self.counters.disk_layer_reads[key] += 1
            self.counters.disk_bytes_read += nbytes

    def _promote(self, key: str, kv: ChunkKV) -> None:
        self._count(ram_evictions=self.ram.put(key, kv))


def _check_key(key: str) -> None:
    if not isinstance(key, str) or len(key) != 64 or not _KEY_CHARS.issuperset(key):
        raise ValueError(f"invalid KV key {key!r}: expected the 64 hex characters of KVStore.key_for()")


def _log_failed_put(future: Future[int]) -> None:
    exc = future.exception()
    if exc is not None:
        log.warning("background write of chunk KV failed: %s", exc)
