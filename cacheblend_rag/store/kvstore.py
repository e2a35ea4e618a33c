"""Chunk KV store: an LRU RAM tier over a persistent disk tier, indexed in SQLite.

Disk layout under the store root::

    index.sqlite                 key -> model, dtype, size, checksum, tier, created, last access (WAL mode)
    chunks/ab/<key>.safetensors  one file per chunk; tensors ``layers.<i>.keys`` / ``layers.<i>.values``
    locks/ab.lock                one lock file per key prefix (256 at most), held while a key is written

Every file is self-describing: its safetensors metadata carries the key, model fingerprint, storage dtype,
layout version, shape, a crc32 per layer (over that layer's K then V bytes) and a crc32 of the metadata
itself. Opening a file checks the metadata (cheap, no tensor bytes read); each layer is checked against its
crc when it is read, so one layer can be loaded alone and still be verified. Files are written to a
temporary name, fsynced and renamed, so a reader sees either nothing or a complete file.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
import weakref
import zlib
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from filelock import Timeout as LockTimeout
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_safetensors

from ..blend.segments import ChunkKV, ChunkKVSource
from ..errors import CorruptKVError, StoreError
from ..models.runtime import ModelShape
from ..settings import get_settings
from .keys import LAYOUT_VERSION, chunk_key, dtype_name, kv_bytes_per_token, resolve_kv_dtype

log = logging.getLogger(__name__)

FILE_FORMAT = "cacheblend-kv"
FILE_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
INDEX_NAME = "index.sqlite"
LOCK_TIMEOUT_S = 120.0
_SAFETENSORS_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
_KEY_CHARS = frozenset("0123456789abcdef")

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


def layer_tensor_names(layer: int) -> tuple[str, str]:
    return f"layers.{layer}.keys", f"layers.{layer}.values"


def tensor_crc32(tensor: torch.Tensor, crc: int = 0) -> int:
    """crc32 of a contiguous CPU tensor's bytes, continuing from ``crc``."""
    return zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy(), crc)


def tier_of(source: ChunkKVSource) -> str:
    """The tier a source returned by :meth:`KVStore.get` was served from: 'ram' or 'disk'."""
    return "disk" if isinstance(source, DiskChunkKV) else "ram"


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


@dataclass
class VerifyReport:
    """What :meth:`KVStore.verify` found (and, with ``repair``, fixed)."""

    checked: int = 0
    ok: int = 0
    corrupt: list[dict[str, str]] = field(default_factory=list)  # key + reason; removed on repair
    missing_files: list[str] = field(default_factory=list)  # index rows without a file; dropped on repair
    orphan_files: list[str] = field(default_factory=list)  # valid files without a row; indexed on repair
    stale_temp_files: list[str] = field(default_factory=list)  # killed writers' leftovers; removed on repair
    repaired: bool = False

    @property
    def clean(self) -> bool:
        return not (self.corrupt or self.missing_files or self.orphan_files or self.stale_temp_files)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "clean": self.clean}


@dataclass(frozen=True)
class _FileMeta:
    key: str
    model_fingerprint: str
    kv_dtype: str
    num_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_crc32: tuple[int, ...]
    checksum: str  # crc32 of the metadata, which covers every layer's crc: identifies the content


class _InvalidFile(Exception):
    """A stored file that must not be used; the message says why."""


def _metadata_crc(fields: dict[str, str]) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return f"{zlib.crc32(canonical):08x}"


def _build_metadata(key: str, fingerprint: str, kv_dtype: str, shape: ModelShape, n: int, crcs: list[int]):
    fields = {
        "format": FILE_FORMAT,
        "layout_version": str(LAYOUT_VERSION),
        "key": key,
        "model_fingerprint": fingerprint,
        "kv_dtype": kv_dtype,
        "num_tokens": str(n),
        "num_layers": str(shape.num_layers),
        "num_kv_heads": str(shape.num_kv_heads),
        "head_dim": str(shape.head_dim),
        "layer_crc32": ",".join(f"{c:08x}" for c in crcs),
    }
    return {**fields, "meta_crc32": _metadata_crc(fields)}


def _parse_metadata(handle, key: str) -> _FileMeta:
    """Check a file's metadata and tensor table against each other and the key it is stored under."""
    meta = handle.metadata() or {}
    if meta.get("format") != FILE_FORMAT:
        raise _InvalidFile(f"not a cacheblend KV file (format {meta.get('format')!r})")
    fields = {k: v for k, v in meta.items() if k != "meta_crc32"}
    if meta.get("meta_crc32") != _metadata_crc(fields):
        raise _InvalidFile("metadata checksum mismatch")
    if meta.get("layout_version") != str(LAYOUT_VERSION):
        raise _InvalidFile(f"layout version {meta.get('layout_version')} (this build reads {LAYOUT_VERSION})")
    if meta.get("key") != key:
        raise _InvalidFile(f"file holds key {str(meta.get('key'))[:16]}…, not the key it is stored under")
    try:
        parsed = _FileMeta(
            key=key,
            model_fingerprint=meta["model_fingerprint"],
            kv_dtype=meta["kv_dtype"],
            num_tokens=int(meta["num_tokens"]),
            num_layers=int(meta["num_layers"]),
            num_kv_heads=int(meta["num_kv_heads"]),
            head_dim=int(meta["head_dim"]),
            layer_crc32=tuple(int(c, 16) for c in meta["layer_crc32"].split(",")),
            checksum=meta["meta_crc32"],
        )
    except (KeyError, ValueError) as exc:
        raise _InvalidFile(f"malformed metadata ({exc})") from None
    if parsed.kv_dtype not in _SAFETENSORS_DTYPES:
        raise _InvalidFile(f"unknown storage dtype {parsed.kv_dtype!r}")
    if len(parsed.layer_crc32) != parsed.num_layers or parsed.num_tokens <= 0:
        raise _InvalidFile("metadata and layer count disagree")
    expected_names = {name for i in range(parsed.num_layers) for name in layer_tensor_names(i)}
    if set(handle.keys()) != expected_names:
        raise _InvalidFile("tensor table does not match the layer count")
    want_shape = [parsed.num_kv_heads, parsed.num_tokens, parsed.head_dim]
    want_dtype = _SAFETENSORS_DTYPES[parsed.kv_dtype]
    for name in expected_names:
        view = handle.get_slice(name)
        if list(view.get_shape()) != want_shape or view.get_dtype() != want_dtype:
            raise _InvalidFile(f"tensor {name} has shape {view.get_shape()} {view.get_dtype()}")
    return parsed


def _open_file(path: Path, key: str):
    """Open and check a stored file. Raises FileNotFoundError if absent, _InvalidFile if unusable."""
    stat = path.stat()
    if stat.st_size == 0:
        raise _InvalidFile("zero-length file")
    try:
        handle = safe_open(str(path), framework="pt")
    except FileNotFoundError:
        raise
    except (SafetensorError, OSError, ValueError) as exc:
        raise _InvalidFile(f"unreadable ({exc})") from None
    return handle, _parse_metadata(handle, key), stat


def _read_layer(handle, meta: _FileMeta, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V (memory-mapped), checked against the layer's crc32."""
    k_name, v_name = layer_tensor_names(layer)
    k, v = handle.get_tensor(k_name), handle.get_tensor(v_name)
    if tensor_crc32(v, tensor_crc32(k)) != meta.layer_crc32[layer]:
        raise _InvalidFile(f"layer {layer} checksum mismatch")
    return k, v


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _make_dirs(path: Path) -> None:
    """mkdir -p where every created directory gets mode 0o755 (never world-writable, whatever the umask)."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o755)
        except FileExistsError:  # another process made it first
            continue
        directory.chmod(0o755)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskChunkKV:
    """A stored chunk served from its memory-mapped file, one verified layer at a time.

    When the chunk fits the RAM tier, each layer read is kept (as an owned copy) and, once every layer has
    been read, the chunk is promoted into the RAM tier; a layer asked for again is served from that copy.
    """

    tier = "disk"

    def __init__(self, store: KVStore, key: str, handle, meta: _FileMeta, stat: os.stat_result, keep: bool):
        self.fingerprint = meta.model_fingerprint
        self.num_tokens = meta.num_tokens
        self.num_layers = meta.num_layers
        self.key = key
        self._store = store
        self._handle = handle
        self._meta = meta
        self._stat = stat
        self._keep = keep
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for a chunk with {self.num_layers} layers")
        with self._lock:
            kept = self._kept.get(layer)
            if kept is not None:
                return kept
            try:
                k, v = _read_layer(self._handle, self._meta, layer)
            except _InvalidFile as exc:
                self._store._discard(self.key, str(exc), self._stat)
                raise CorruptKVError(
                    self.key, f"stored KV of chunk {self.key[:16]}… is corrupt: {exc}; it was removed", layer
                ) from None
            self._store._count_layer_read(self.key, k.nbytes + v.nbytes)
            if not self._keep:
                return k, v
            k, v = k.clone(), v.clone()
            self._kept[layer] = (k, v)
            if len(self._kept) == self.num_layers:
                layers = [self._kept[i] for i in range(self.num_layers)]
                self._store._promote(
                    self.key, ChunkKV([kv[0] for kv in layers], [kv[1] for kv in layers], self.fingerprint)
                )
            return k, v


class _RamTier:
    """LRU of ChunkKV within a byte budget."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.bytes = 0
        self._entries: OrderedDict[str, ChunkKV] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> ChunkKV | None:
        with self._lock:
            kv = self._entries.get(key)
            if kv is not None:
                self._entries.move_to_end(key)
            return kv

    def put(self, key: str, kv: ChunkKV) -> int:
        """Insert (or refresh) ``kv``; returns how many entries were evicted to make room."""
        size = kv.nbytes
        evicted = 0
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes
            if size > self.budget:
                return 0
            while self.bytes + size > self.budget:
                _, dropped = self._entries.popitem(last=False)
                self.bytes -= dropped.nbytes
                evicted += 1
            self._entries[key] = kv
            self.bytes += size
        return evicted

    def pop(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0


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
        self.disk_budget_bytes = disk_budget
        if ram_budget < 0 or self.disk_budget_bytes < 0:
            raise ValueError("store byte budgets must be >= 0")
        self.promote_on_read = promote_on_read
        self._bytes_per_token = kv_bytes_per_token(shape, self.kv_dtype)
        self.counters = StoreCounters()
        self._ram = _RamTier(ram_budget)
        self._live: weakref.WeakValueDictionary[str, DiskChunkKV] = weakref.WeakValueDictionary()
        self._mutex = threading.Lock()
        self._db_lock = threading.Lock()
        self._locks: dict[str, FileLock] = {}
        self._writer: ThreadPoolExecutor | None = None
        self._chunks_dir = self.root / "chunks"
        self._locks_dir = self.root / "locks"
        self.read_only = False
        self._db = self._open_index()
        if not self.read_only:
            self._sql(
                "INSERT OR IGNORE INTO models VALUES (?, ?, ?, ?)",
                (self.fingerprint, self.kv_dtype_name, json.dumps(asdict(shape)), time.time()),
            )

    # -- opening -------------------------------------------------------------------------------------

    @classmethod
    def open_existing(cls, root: str | Path, model_fingerprint: str | None = None, **kwargs: Any) -> KVStore:
        """Open a store that already exists, taking the model shape and dtype from its index.

        Without ``model_fingerprint`` the store must hold KV of exactly one model.
        """
        index = Path(root) / INDEX_NAME
        if not index.is_file():
            raise StoreError(f"no KV store at {root} (missing {INDEX_NAME})")
        try:
            with closing(cls._connect_read_only(index)) as db:
                rows = db.execute("SELECT model_fingerprint, kv_dtype, shape FROM models").fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read the KV index {index}: {exc}") from exc
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
        return cls(root, fingerprint, ModelShape(**json.loads(shape)), **kwargs)

    def _open_index(self) -> sqlite3.Connection:
        index = self.root / INDEX_NAME
        try:
            _make_dirs(self.root)
        except OSError as exc:
            if not self.root.is_dir():
                raise StoreError(f"cannot create the KV store directory {self.root}: {exc}") from exc
        writable = os.access(self.root, os.W_OK) and (not index.exists() or os.access(index, os.W_OK))
        self.read_only = not writable
        try:
            if self.read_only:
                if not index.is_file():
                    raise StoreError(f"the KV store directory {self.root} is read-only and holds no index")
                db = self._connect_read_only(index)
            else:
                db = sqlite3.connect(index, timeout=30, isolation_level=None, check_same_thread=False)
                db.execute("PRAGMA busy_timeout = 30000")
                db.execute("PRAGMA journal_mode = WAL")
                db.execute("PRAGMA synchronous = NORMAL")  # in WAL mode: consistent, no fsync per commit
                db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the KV index {index}: {exc}") from exc
        return db

    @staticmethod
    def _connect_read_only(index: Path) -> sqlite3.Connection:
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

    def close(self) -> None:
        """Wait for background writes and close the index."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        with self._db_lock:
            self._db.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- keys and paths ------------------------------------------------------------------------------

    def key_for(self, token_ids: Sequence[int]) -> str:
        """The key of the chunk made of ``token_ids`` under this store's model and storage dtype."""
        return chunk_key(self.fingerprint, self.kv_dtype, token_ids)

    def path_for(self, key: str) -> Path:
        """Where the disk tier keeps ``key``'s file."""
        _check_key(key)
        return self._chunks_dir / key[:2] / f"{key}{FILE_SUFFIX}"

    @contextmanager
    def _lock_for(self, key: str, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
        """Hold the inter-process lock of ``key``'s prefix (raises filelock.Timeout after ``timeout``)."""
        shard = key[:2]
        with self._mutex:
            lock = self._locks.get(shard)
            if lock is None:
                _make_dirs(self._locks_dir)
                lock = FileLock(self._locks_dir / f"{shard}.lock", mode=0o644)
                self._locks[shard] = lock
        with lock.acquire(timeout=timeout):
            yield

    def _require_writable(self, action: str) -> None:
        if self.read_only:
            raise StoreError(f"the KV store at {self.root} is read-only; cannot {action}")

    # -- reads ---------------------------------------------------------------------------------------

    def contains(self, key: str) -> bool:
        """Whether ``key`` is in RAM or has a file on disk (the file is checked only when read)."""
        return key in self._ram or self.path_for(key).is_file()

    def get(self, key: str) -> ChunkKVSource | None:
        """The chunk's KV from the RAM tier, else from disk; None on a miss.

        A file that is truncated, corrupted or foreign is logged, removed and reported as a miss. A layer
        whose bytes fail their checksum raises :class:`CorruptKVError` when that layer is read.
        """
        kv = self._ram.get(key)
        if kv is not None:
            self._count(ram_hits=1)
            self._touch(key)
            return kv
        self._count(ram_misses=1)
        live = self._live.get(key)
        if live is not None:
            self._count(disk_hits=1)
            self._touch(key)
            return live
        path = self.path_for(key)
        try:
            handle, meta, stat = _open_file(path, key)
            self._check_ours(meta)
        except FileNotFoundError:
            self._count(disk_misses=1)
            return None
        except _InvalidFile as exc:
            self._discard(key, str(exc), None)
            self._count(disk_misses=1)
            return None
        self._count(disk_hits=1)
        self._touch(key, adopt=(meta, stat.st_size))
        keep = self.promote_on_read and meta.num_tokens * self._bytes_per_token <= self._ram.budget
        source = DiskChunkKV(self, key, handle, meta, stat, keep)
        self._live[key] = source
        return source

    def get_many(self, keys: Sequence[str]) -> list[ChunkKVSource | None]:
        """:meth:`get` for each key; a key repeated in ``keys`` maps to the same source (read once)."""
        found: dict[str, ChunkKVSource | None] = {}
        for key in keys:
            if key not in found:
                found[key] = self.get(key)
        return [found[key] for key in keys]

    def _check_ours(self, meta: _FileMeta) -> None:
        if meta.model_fingerprint != self.fingerprint:
            raise _InvalidFile(f"foreign file of model {meta.model_fingerprint[:16]}…")
        if meta.kv_dtype != self.kv_dtype_name:
            raise _InvalidFile(f"foreign file in {meta.kv_dtype} (store keeps {self.kv_dtype_name})")
        shape = (meta.num_layers, meta.num_kv_heads, meta.head_dim)
        if shape != (self.shape.num_layers, self.shape.num_kv_heads, self.shape.head_dim):
            raise _InvalidFile(f"foreign file of shape {shape}")

    # -- writes --------------------------------------------------------------------------------------

    def put(self, key: str, kv: ChunkKV, ram: bool = True) -> int:
        """Store ``kv`` under ``key`` in the storage dtype, on disk (atomically) and in RAM.

        Returns the bytes written to disk: 0 when another writer had already stored a valid file.
        Raises StoreError when the store is read-only or the disk is full; nothing stored is changed.
        """
        tensors, crcs = self._prepare(key, kv)
        self._require_writable(f"store chunk {key[:16]}…")
        path = self.path_for(key)
        metadata = _build_metadata(key, self.fingerprint, self.kv_dtype_name, self.shape, kv.num_tokens, crcs)
        try:
            with self._lock_for(key):
                # another process may have stored this chunk while we computed it: keep its file
                written = 0 if self._valid_header(path, key) else self._write_file(path, tensors, metadata)
                _, meta, stat = _open_file(path, key)
                self._index_file(key, meta, stat.st_size)
        except LockTimeout:
            raise StoreError(f"timed out waiting for the writer of {key[:16]}… in {self.root}") from None
        except OSError as exc:
            raise _os_error(exc, f"store chunk {key[:16]}… in", self.root) from exc
        if ram:
            stored = ChunkKV(
                [tensors[layer_tensor_names(i)[0]] for i in range(self.shape.num_layers)],
                [tensors[layer_tensor_names(i)[1]] for i in range(self.shape.num_layers)],
                self.fingerprint,
            )
            self._count(ram_evictions=self._ram.put(key, stored))
        self._count(puts=1, bytes_written=written)
        self._enforce_disk_budget(keep=key)
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

    def _prepare(self, key: str, kv: ChunkKV) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Validate ``kv`` and copy it into contiguous CPU tensors of the storage dtype."""
        _check_key(key)
        if kv.fingerprint != self.fingerprint:
            raise StoreError(
                f"chunk KV of model {kv.fingerprint[:16]}… cannot go into the store of model "
                f"{self.fingerprint[:16]}…"
            )
        if kv.num_layers != self.shape.num_layers or len(kv.values) != self.shape.num_layers:
            raise StoreError(f"chunk KV has {kv.num_layers} layers; the model has {self.shape.num_layers}")
        n = kv.num_tokens
        want = (self.shape.num_kv_heads, n, self.shape.head_dim)
        if n <= 0:
            raise StoreError("cannot store the KV of an empty chunk")
        tensors: dict[str, torch.Tensor] = {}
        crcs = []
        for i in range(self.shape.num_layers):
            k, v = kv.layer(i)
            if tuple(k.shape) != want or tuple(v.shape) != want:
                raise StoreError(f"layer {i} K/V shapes {tuple(k.shape)}/{tuple(v.shape)}; expected {want}")
            k_out = torch.empty(want, dtype=self.kv_dtype).copy_(k)
            v_out = torch.empty(want, dtype=self.kv_dtype).copy_(v)
            k_name, v_name = layer_tensor_names(i)
            tensors[k_name], tensors[v_name] = k_out, v_out
            crcs.append(tensor_crc32(v_out, tensor_crc32(k_out)))
        return tensors, crcs

    def _valid_header(self, path: Path, key: str) -> bool:
        try:
            _, meta, _ = _open_file(path, key)
            self._check_ours(meta)
        except (FileNotFoundError, _InvalidFile):
            return False
        return True

    def _write_file(self, path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
        data = save_safetensors(tensors, metadata=metadata)
        _make_dirs(path.parent)
        temp = path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)
        return len(data)

    # -- removal -------------------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Remove ``key`` from both tiers. Returns whether anything was removed."""
        _check_key(key)
        self._require_writable(f"delete chunk {key[:16]}…")
        in_ram = key in self._ram
        self._ram.pop(key)
        self._live.pop(key, None)
        return self._remove_from_disk(key, LOCK_TIMEOUT_S) or in_ram

    def evict_ram(self, key: str | None = None) -> None:
        """Drop ``key`` (or everything) from the RAM tier only, so the next get reads the disk tier."""
        if key is None:
            self._ram.clear()
            self._live.clear()
        else:
            self._ram.pop(key)
            self._live.pop(key, None)

    def clear(self) -> int:
        """Remove every entry of every model in this root, in RAM and on disk. Returns files removed."""
        self._require_writable("clear it")
        self.evict_ram()
        removed = 0
        for path in self._chunk_files():
            key = path.name.removesuffix(FILE_SUFFIX)
            removed += self._remove_from_disk(key, LOCK_TIMEOUT_S)
        for temp in self._temp_files():
            temp.unlink(missing_ok=True)
        self._sql("DELETE FROM chunks")
        return removed

    def _remove_from_disk(self, key: str, lock_timeout: float) -> bool:
        path = self.path_for(key)
        try:
            with self._lock_for(key, lock_timeout):
                existed = path.exists()
                path.unlink(missing_ok=True)
                self._sql("DELETE FROM chunks WHERE key = ?", (key,))
        except LockTimeout:
            return False
        except OSError as exc:
            raise _os_error(exc, f"remove chunk {key[:16]}… from", self.root) from exc
        return existed

    def _discard(self, key: str, reason: str, seen: os.stat_result | None) -> None:
        """Drop a bad entry so the caller recomputes it. ``seen``: the file as it was when opened; a file
        a concurrent writer has since put in its place is left alone."""
        log.warning("KV store %s: chunk %s… is unusable (%s); removed", self.root, key[:16], reason)
        self._count(corrupt=1)
        self._ram.pop(key)
        self._live.pop(key, None)
        if self.read_only:
            return
        path = self.path_for(key)
        try:
            with self._lock_for(key):
                if seen is not None:
                    now = path.stat()
                    if (now.st_ino, now.st_mtime_ns) != (seen.st_ino, seen.st_mtime_ns):
                        return
                path.unlink(missing_ok=True)
                self._sql("DELETE FROM chunks WHERE key = ?", (key,))
        except FileNotFoundError:
            self._sql("DELETE FROM chunks WHERE key = ?", (key,))
        except (OSError, LockTimeout, StoreError) as exc:
            log.warning("KV store %s: could not remove bad chunk %s…: %s", self.root, key[:16], exc)

    # -- maintenance ---------------------------------------------------------------------------------

    def verify(self, repair: bool = False) -> VerifyReport:
        """Read and check every file (metadata and every layer's checksum) and the index against the files.

        Files of other models in the same root are checked for self-consistency. With ``repair``, corrupt
        files and leftovers of killed writers are removed, rows without files dropped, valid files without
        rows indexed.
        """
        if repair:
            self._require_writable("repair it")
        report = VerifyReport(repaired=repair)
        rows = {key: checksum for key, checksum in self._sql("SELECT key, checksum FROM chunks")}
        seen: set[str] = set()
        for path in self._chunk_files():
            key = path.name.removesuffix(FILE_SUFFIX)
            report.checked += 1
            seen.add(key)
            try:
                handle, meta, stat = _open_file(path, key)
                for layer in range(meta.num_layers):
                    _read_layer(handle, meta, layer)
            except FileNotFoundError:
                continue
            except _InvalidFile as exc:
                report.corrupt.append({"key": key, "reason": str(exc)})
                if repair:
                    self._discard(key, str(exc), None)
                continue
            report.ok += 1
            if rows.get(key) != meta.checksum:
                report.orphan_files.append(key)
                if repair:
                    self._index_file(key, meta, stat.st_size)
        report.missing_files = sorted(set(rows) - seen)
        if repair:
            for key in report.missing_files:
                self._sql("DELETE FROM chunks WHERE key = ?", (key,))
        report.stale_temp_files = [str(p) for p in self._stale_temp_files(remove=repair)]
        return report

    def gc(self) -> dict[str, int]:
        """Enforce the disk budget (LRU by last access) and reconcile the index with the files: drop rows
        without files, index valid files without rows, remove unreadable files and stale temp files."""
        self._require_writable("collect garbage")
        report = {"rows_dropped": 0, "files_indexed": 0, "files_removed": 0, "temp_removed": 0, "evicted": 0}
        rows = {key for (key,) in self._sql("SELECT key FROM chunks")}
        on_disk = set()
        for path in self._chunk_files():
            key = path.name.removesuffix(FILE_SUFFIX)
            on_disk.add(key)
            if key in rows:
                continue
            try:
                _, meta, stat = _open_file(path, key)
            except FileNotFoundError:
                continue
            except _InvalidFile as exc:
                self._discard(key, str(exc), None)
                report["files_removed"] += 1
                continue
            self._index_file(key, meta, stat.st_size)
            report["files_indexed"] += 1
        for key in rows - on_disk:
            if not self.path_for(key).exists():  # not written meanwhile by another process
                self._sql("DELETE FROM chunks WHERE key = ?", (key,))
                report["rows_dropped"] += 1
        report["temp_removed"] = len(self._stale_temp_files(remove=True))
        report["evicted"] = self._enforce_disk_budget()
        return report

    def _enforce_disk_budget(self, keep: str | None = None) -> int:
        if self.read_only:
            return 0
        (total,) = self._sql("SELECT COALESCE(SUM(size_bytes), 0) FROM chunks")[0]
        if total <= self.disk_budget_bytes:
            return 0
        evicted = 0
        for key, size in self._sql("SELECT key, size_bytes FROM chunks ORDER BY last_access, created"):
            if total <= self.disk_budget_bytes:
                break
            if key == keep:
                continue
            # a key another process is writing right now is skipped rather than waited for
            if self._remove_from_disk(key, lock_timeout=0):
                total -= size
                evicted += 1
        self._count(disk_evictions=evicted)
        if total > self.disk_budget_bytes:
            budget = self.disk_budget_bytes
            log.warning("KV store %s: %d bytes on disk exceed the budget %d", self.root, total, budget)
        return evicted

    def _stale_temp_files(self, remove: bool) -> list[Path]:
        """Temp files whose key no writer holds the lock of: leftovers of a killed writer."""
        if self.read_only:  # no writer can be at work on a read-only file system
            return self._temp_files()
        stale = []
        for temp in self._temp_files():
            key = temp.name[1:].split(".", 1)[0]
            try:
                with self._lock_for(key, timeout=0):
                    if not temp.exists():
                        continue
                    stale.append(temp)
                    if remove:
                        temp.unlink(missing_ok=True)
            except LockTimeout:
                continue
        return stale

    def _chunk_files(self) -> list[Path]:
        return sorted(self._chunks_dir.glob(f"??/*{FILE_SUFFIX}"))

    def _temp_files(self) -> list[Path]:
        return sorted(self._chunks_dir.glob(f"??/.*{TEMP_SUFFIX}"))

    # -- statistics ----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Entries and bytes per tier, budgets, and this process's counters."""
        (entries, size, models) = self._sql(
            "SELECT count(*), COALESCE(SUM(size_bytes), 0), count(DISTINCT model_fingerprint) FROM chunks"
        )[0]
        (mine,) = self._sql("SELECT count(*) FROM chunks WHERE model_fingerprint = ?", (self.fingerprint,))[0]
        return {
            "root": str(self.root),
            "model_fingerprint": self.fingerprint,
            "kv_dtype": self.kv_dtype_name,
            "layout_version": LAYOUT_VERSION,
            "read_only": self.read_only,
            "ram": {"entries": len(self._ram), "bytes": self._ram.bytes, "budget_bytes": self._ram.budget},
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
        self._count(ram_evictions=self._ram.put(key, kv))

    # -- index ---------------------------------------------------------------------------------------

    def _sql(self, query: str, params: Sequence[Any] = ()) -> list[tuple]:
        try:
            with self._db_lock:
                return self._db.execute(query, params).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"KV index {self.root / INDEX_NAME}: {exc}") from exc

    def _index_file(self, key: str, meta: _FileMeta, size: int) -> None:
        """Insert or refresh ``key``'s row (also used to index a valid file whose writer died before)."""
        now = time.time()
        row = (key, meta.model_fingerprint, meta.kv_dtype, LAYOUT_VERSION, meta.num_tokens, size)
        self._sql(
            "INSERT INTO chunks VALUES (?, ?, ?, ?, ?, ?, ?, 'disk', ?, ?) ON CONFLICT (key) DO UPDATE SET "
            "size_bytes = excluded.size_bytes, checksum = excluded.checksum, "
            "last_access = excluded.last_access",
            (*row, meta.checksum, now, now),
        )

    def _touch(self, key: str, adopt: tuple[_FileMeta, int] | None = None) -> None:
        """Record an access for disk LRU; index a valid file found without a row (its writer died)."""
        if self.read_only:
            return
        try:
            with self._db_lock:
                query = "UPDATE chunks SET last_access = ? WHERE key = ?"
                updated = self._db.execute(query, (time.time(), key))
            if updated.rowcount == 0 and adopt is not None:
                self._index_file(key, *adopt)
        except (sqlite3.Error, StoreError) as exc:  # an access time is not worth failing a read for
            log.debug("KV store %s: cannot record access of %s…: %s", self.root, key[:16], exc)


def _check_key(key: str) -> None:
    if not isinstance(key, str) or len(key) != 64 or not _KEY_CHARS.issuperset(key):
        raise ValueError(f"invalid KV key {key!r}: expected the 64 hex characters of KVStore.key_for()")


def _os_error(exc: OSError, action: str, root: Path) -> StoreError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreError(f"disk full: cannot {action} {root} ({exc.strerror}); nothing stored was changed")
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return StoreError(f"the KV store at {root} is read-only: cannot {action} it ({exc.strerror})")
    return StoreError(f"cannot {action} {root}: {exc}")


def _log_failed_put(future: Future[int]) -> None:
    exc = future.exception()
    if exc is not None:
        log.warning("background write of chunk KV failed: %s", exc)
