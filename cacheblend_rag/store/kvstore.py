"""The chunk KV store: an LRU RAM tier (:mod:`.ram`) over a persistent disk tier (:mod:`.disk`), indexed
in SQLite (:mod:`.index`), files in the format of :mod:`.fileformat`; optionally over a remote tier shared
by several nodes (:mod:`.remote`, Redis/Valkey; ``remote=`` or the ``kv_remote`` setting).

Disk layout under the store root::

    index.sqlite                 key -> model, dtype, size, checksum, tier, created, last access (WAL mode)
    chunks/ab/<key>.safetensors  one file per chunk; tensors ``layers.<i>.keys`` / ``layers.<i>.values``
    locks/ab.lock                one lock file per key prefix (256 at most), held while a key is written

A read tries the RAM tier, then the disk, then the remote tier (read-through: a chunk read whole from it is
then kept in RAM and written to the local disk); a write goes to all (pinned in the remote tier for corpus
KV, with a TTL for a request's). Every file and remote value is self-describing and checked (metadata on
open, each layer's crc32 when it is read); a bad one is logged, removed and recomputed. The remote tier
never raises into an answer: while it is down it reports misses and skips writes (one warning per outage).
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
from ..config import DEFAULT_DISK_BUDGET_BYTES, DEFAULT_KV_DTYPE, DEFAULT_RAM_BUDGET_BYTES
from ..errors import CorruptKVError, StoreError
from ..models.runtime import ModelShape
from . import maintenance
from .disk import LOCK_TIMEOUT_S, DiskChunkKV, DiskTier, make_dirs
from .exact import clear_exact_files
from .fileformat import EncodedChunk, encode
from .index import KV_INDEX_NAME, KVIndex, stored_models
from .keys import check_key, chunk_key, dtype_name, resolve_codec
from .maintenance import VerifyReport
from .ram import RamTier
from .remote import RedisKVTier, connect_remote
from .tier import tier_of

log = logging.getLogger(__name__)

__all__ = ["KV_INDEX_NAME", "DiskChunkKV", "KVStore", "StoreCounters", "VerifyReport", "tier_of"]


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
    """Chunk KV of one model and storage codec (``kv_dtype``: float16, bfloat16, float32, int8, int4; see
    :mod:`.codec`): RAM tier (LRU, byte budget) over disk files (LRU, budget),
    over an optional shared remote tier (``remote``: a :class:`RedisKVTier` or its URL; None or '': none).
    The defaults of the codec and budgets are those of :mod:`cacheblend_rag.config`.

    Safe for several threads and several processes on the same root. Returned sources implement
    :class:`ChunkKVSource`; their tensors are in :attr:`kv_dtype` (the codec's decoded dtype: float16 for
    int8/int4) and must not be modified in place. Every tier keeps the encoded bytes.
    """

    def __init__(
        self,
        root: str | Path,
        model_fingerprint: str,
        shape: ModelShape,
        kv_dtype: torch.dtype | str = DEFAULT_KV_DTYPE,
        ram_budget_bytes: int = DEFAULT_RAM_BUDGET_BYTES,
        disk_budget_bytes: int = DEFAULT_DISK_BUDGET_BYTES,
        promote_on_read: bool = True,
        remote: RedisKVTier | str | None = None,
    ) -> None:
        if not model_fingerprint:
            raise StoreError("KVStore needs the model fingerprint (LayerwiseModel.fingerprint)")
        self.root = Path(root)
        self.fingerprint = model_fingerprint
        self.shape = shape
        self.codec = resolve_codec(kv_dtype)
        self.kv_dtype = self.codec.dtype  # what sources serve
        self.kv_dtype_name = self.codec.name
        disk_budget, ram_budget = disk_budget_bytes, ram_budget_bytes
        if ram_budget < 0 or disk_budget < 0:
            raise ValueError("store byte budgets must be >= 0")
        self.promote_on_read = promote_on_read
        self.counters = StoreCounters()
        self._mutex = threading.Lock()
        self._writer: ThreadPoolExecutor | None = None
        self.closed = False
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
            self.codec,
            disk_budget,
            count=self._count,
            on_layer_read=self._count_layer_read,
            forget=self.ram.delete,
        )
        self.remote = connect_remote(remote, self.fingerprint, shape, self.codec.name)
        self._owns_remote = not isinstance(remote, RedisKVTier)  # a tier given may serve other stores
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
    def open_existing(
        cls,
        root: str | Path,
        model_fingerprint: str | None = None,
        prefer_kv_dtype: torch.dtype | str = DEFAULT_KV_DTYPE,
        **kwargs: Any,
    ) -> KVStore:
        """Open a store that already exists, taking the model shape and dtype from its index (of a model
        stored in several codecs, ``prefer_kv_dtype`` if it is one of them). ``kwargs``: as for
        :class:`KVStore`.

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
        # one model may have been stored in several dtypes: prefer the caller's
        configured = dtype_name(prefer_kv_dtype)
        fingerprint, kv_dtype, shape = next((r for r in rows if r[1] == configured), rows[0])
        kwargs.setdefault("kv_dtype", kv_dtype)
        return cls(root, fingerprint, shape, **kwargs)

    def close(self) -> None:
        """Wait for background writes and close the index (and the remote tier this store opened)."""
        self.closed = True
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        self.index.close()
        if self.remote is not None and self._owns_remote:
            self.remote.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- keys and paths ------------------------------------------------------------------------------

    def chunk_key(self, token_ids: Sequence[int], context: str = "") -> str:
        """The key of the chunk made of ``token_ids`` under this store's model and storage codec,
        prefilled behind the chunk context whose ``ChunkContext.key`` is ``context``. The one place a
        chunk's key is made for a store (corpus, engines and ingest all ask it), so a key never names
        another codec than the store that reads it."""
        return chunk_key(self.fingerprint, self.codec.name, token_ids, context)

    def path_for(self, key: str) -> Path:
        """Where the disk tier keeps ``key``'s file."""
        check_key(key)
        return self.disk.path_for(key)

    # -- reads ---------------------------------------------------------------------------------------

    def contains(self, key: str, remote: bool = True) -> bool:
        """Whether ``key`` is in RAM, has a file on local disk or (with ``remote``) is held by the remote
        tier. Nothing is checked here: a file or value is checked when it is read."""
        check_key(key)
        if self.ram.contains(key) or self.disk.contains(key):
            return True
        return remote and self.remote is not None and self.remote.contains(key)

    def get(self, key: str) -> ChunkKVSource | None:
        """The chunk's KV from the RAM tier, else from disk, else from the remote tier; None on a miss.

        A file that is truncated, corrupted or foreign is logged, removed and reported as a miss. A layer
        whose bytes fail their checksum raises :class:`CorruptKVError` when that layer is read.
        """
        check_key(key)
        kv = self.ram.get(key)
        if kv is not None:
            self._count(ram_hits=1)
            self.index.touch(key)
            return kv
        self._count(ram_misses=1)
        limit = self.ram.budget if self.promote_on_read else -1
        found = self.disk.get(key, self._promote, promote_max_bytes=limit)
        if found is None and self.remote is not None:
            return self.remote.get(key, on_complete=self._filled_from_remote)
        return found

    def get_many(self, keys: Sequence[str]) -> list[ChunkKVSource | None]:
        """:meth:`get` for each key; a key repeated in ``keys`` maps to the same source (read once)."""
        found: dict[str, ChunkKVSource | None] = {}
        for key in keys:
            if key not in found:
                found[key] = self.get(key)
        return [found[key] for key in keys]

    # -- writes --------------------------------------------------------------------------------------

    def encode(self, key: str, kv: ChunkKV) -> EncodedChunk:
        """``kv`` in this store's codec under ``key`` (a source serving exactly what the store will)."""
        check_key(key)
        return encode(key, kv, self.fingerprint, self.shape, self.codec)

    def put(self, key: str, kv: ChunkKV | EncodedChunk, ram: bool = True, pinned: bool = True) -> int:
        """Store ``kv`` (or a chunk :meth:`encode` made) under ``key`` in the store's codec, on disk
        (atomically) and in RAM, and write it through to the remote tier if there is one (``pinned``: as
        corpus KV, never evicted there; else as a request's KV, with a TTL).

        Returns the bytes written to disk: 0 when another writer had already stored a valid file.
        Raises StoreError when the store is read-only or the disk is full; nothing stored is changed.
        """
        encoded = self._encoded(key, kv)
        written = self._put_local(key, encoded, ram)
        if self.remote is not None:
            self.remote.put(key, encoded, pinned)
        return written

    def put_local(self, key: str, kv: ChunkKV | EncodedChunk, ram: bool = True) -> int:
        """:meth:`put` to the RAM and disk tiers only."""
        return self._put_local(key, self._encoded(key, kv), ram)

    def _encoded(self, key: str, kv: ChunkKV | EncodedChunk) -> EncodedChunk:
        if not isinstance(kv, EncodedChunk):
            return self.encode(key, kv)
        check_key(key)
        if kv.codec.name != self.codec.name or kv.fingerprint != self.fingerprint:
            raise StoreError("the encoded chunk is of another model or codec than the store")
        if kv.metadata.get("key") != key:
            raise StoreError(f"the encoded chunk was made for another key than {key[:16]}…")
        return kv

    def _put_local(self, key: str, encoded: EncodedChunk, ram: bool) -> int:
        written = self.disk.write(key, encoded)
        if ram:
            self._count(ram_evictions=self.ram.put(key, encoded))
        self._count(puts=1)
        return written

    def put_async(self, key: str, kv: ChunkKV | EncodedChunk, pinned: bool = False) -> Future[int]:
        """:meth:`put` on a background thread (for write-back of chunks a request had to compute: by
        default request traffic, evictable in the remote tier)."""
        return self._in_background(self.put, key, kv, pinned=pinned)

    def _in_background(self, put, key: str, kv: ChunkKV | EncodedChunk, **options: Any) -> Future[int]:
        with self._mutex:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-writer")
        future = self._writer.submit(put, key, kv, **options)
        future.add_done_callback(_log_failed_put)
        return future

    def pin(self, key: str) -> bool:
        """Make sure the remote tier holds ``key`` as pinned corpus KV (what ingest does for a chunk that
        is already stored somewhere): a copy there with a TTL is made permanent, else the local copy is
        pushed. Returns whether the remote tier holds it pinned now; False without a remote tier, while
        it is down, or when neither tier holds a usable copy."""
        check_key(key)
        if self.remote is None:
            return False
        if self.remote.pin(key):
            return True
        if not self.remote.available:
            return False
        kv = self._local_kv(key)
        if kv is None:
            return False
        self.remote.put(key, kv, pinned=True)
        return self.remote.pin(key)  # held now, whether this put or a concurrent writer's stored it

    def flush(self) -> None:
        """Wait until every :meth:`put_async` so far has finished."""
        with self._mutex:
            writer = self._writer
        if writer is not None:
            writer.submit(lambda: None).result()

    # -- removal -------------------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Remove ``key`` from every tier, the remote one included. Returns whether anything was removed."""
        check_key(key)
        self.disk.require_writable(f"delete chunk {key[:16]}…")
        in_ram = self.ram.delete(key)
        self.disk.drop_live(key)
        in_remote = self.remote is not None and self.remote.delete(key)
        return self.disk.delete(key, LOCK_TIMEOUT_S) or in_ram or in_remote

    def evict_ram(self, key: str | None = None) -> None:
        """Drop ``key`` (or everything) from the RAM tier only, so the next get reads the disk tier."""
        if key is None:
            self.ram.clear()
        else:
            self.ram.delete(key)
        self.disk.drop_live(key)

    def clear(self) -> int:
        """Remove every entry of every model in this root, in RAM and on disk (not the shared remote
        tier, which other nodes use: see its :meth:`~RedisKVTier.gc`). Returns files removed."""
        self.disk.require_writable("clear it")
        self.evict_ram()
        clear_exact_files(self.root)  # openings' exact KV, kept beside the chunks (store/exact.py)
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
        """Entries and bytes per tier, budgets, and this process's counters; ``remote``: the remote tier's
        facts and counters (:meth:`RedisKVTier.describe`; no server call), or None."""
        return {
            "root": str(self.root),
            "model_fingerprint": self.fingerprint,
            "kv_dtype": self.kv_dtype_name,
            "codec": {"name": self.codec.name, "params": self.codec.params, "decoded": str(self.kv_dtype)},
            "layout_version": self.codec.layout_version,
            "read_only": self.read_only,
            "ram": {"entries": len(self.ram), "bytes": self.ram.bytes, "budget_bytes": self.ram.budget},
            "disk": {**self.index.usage(self.fingerprint), "budget_bytes": self.disk_budget_bytes},
            "counters": self.counters.as_dict(),
            "remote": self.remote.describe() if self.remote is not None else None,
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

    def _promote(self, key: str, kv: EncodedChunk) -> None:
        self._count(ram_evictions=self.ram.put(key, kv))

    # -- remote tier (the logic is in store/remote/) ---------------------------------------------------

    def _filled_from_remote(self, key: str, kv: EncodedChunk) -> None:
        """Every layer of a remote chunk has been read: keep it in RAM and on local disk."""
        if self.promote_on_read:
            self._promote(key, kv)
        if not self.read_only:
            self._in_background(self.put_local, key, kv, ram=False)

    def _local_kv(self, key: str) -> EncodedChunk | None:
        """The chunk's whole encoded KV from RAM or the local disk (every layer checked), or None."""
        kv = self.ram.get(key)
        if kv is not None:
            return kv
        source = self.disk.get(key)
        if source is None:
            return None
        try:
            return source.encoded()
        except CorruptKVError as exc:  # removed by the disk tier; the caller recomputes it
            log.warning("chunk KV %s… not pushed to the remote tier: %s", key[:16], exc)
            return None


def _log_failed_put(future: Future[int]) -> None:
    exc = future.exception()
    if exc is not None:
        log.warning("background write of chunk KV failed: %s", exc)
