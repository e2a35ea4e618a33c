"""The disk tier: one file per chunk (:mod:`.fileformat`) under ``ROOT/chunks``, read memory-mapped,
indexed in SQLite (:mod:`.index`) for LRU eviction, stats and verification.

Layout::

    chunks/ab/<key>.safetensors  one file per chunk
    locks/ab.lock                one lock file per key prefix (256 at most), held while a key is written

Files are written to a temporary name, fsynced and renamed, so a reader sees either nothing or a complete
file. Directories are created 0755 and files 0644: never world-writable, whatever the umask. Safe for
several threads and processes on one root.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock
from filelock import Timeout as LockTimeout

from ..blend.segments import ChunkKV
from ..errors import CorruptKVError, StoreError
from ..models.runtime import ModelShape
from .codec import Codec
from .fileformat import (
    EncodedChunk,
    FileMeta,
    InvalidKVFile,
    Parts,
    check_model,
    encode,
    open_file,
    read_parts,
)
from .index import KVIndex
from .tier import StoredChunkKV

log = logging.getLogger(__name__)

FILE_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
LOCK_TIMEOUT_S = 120.0


class DiskChunkKV(StoredChunkKV):
    """A stored chunk served from its memory-mapped file, one verified, decoded layer at a time.

    With ``promote``, each layer's encoded parts are kept (as an owned copy) and, once every layer has
    been read, the whole chunk is handed to ``promote`` (the RAM tier, which keeps it encoded); a layer
    asked for again is decoded from that copy.
    """

    tier = "disk"

    def __init__(
        self, disk: DiskTier, key: str, handle, meta: FileMeta, stat: os.stat_result, promote
    ) -> None:
        super().__init__(key, meta, handle.metadata() or {}, promote)
        self._disk = disk
        self._handle = handle
        self._meta = meta
        self._stat = stat

    def _read(self, layer: int) -> Parts:
        try:
            parts = read_parts(self._handle, self._meta, layer)
        except InvalidKVFile as exc:
            self._disk.discard(self.key, str(exc), self._stat)
            raise CorruptKVError(
                self.key, f"stored KV of chunk {self.key[:16]}… is corrupt: {exc}; it was removed", layer
            ) from None
        self._disk.on_layer_read(self.key, sum(t.nbytes for t in parts.values()))
        return parts

    def _own(self, parts: Parts) -> Parts:
        # memory-mapped: kept copies must not depend on the file
        return {name: t.clone() for name, t in parts.items()}


class DiskTier:
    """The disk tier of one store root for one model and storage codec (a :class:`~.tier.KVTier`).

    ``count(**deltas)`` and ``on_layer_read(key, nbytes)`` report to the store's counters; ``forget(key)``
    is told when a key leaves the disk (so faster tiers drop it too)."""

    name = "disk"

    def __init__(
        self,
        root: Path,
        index: KVIndex,
        fingerprint: str,
        shape: ModelShape,
        codec: Codec,
        budget_bytes: int,
        count: Callable[..., None],
        on_layer_read: Callable[[str, int], None],
        forget: Callable[[str], None],
    ) -> None:
        self.root = root
        self.index = index
        self.fingerprint = fingerprint
        self.shape = shape
        self.codec = codec
        self.kv_dtype_name = codec.name
        self.budget_bytes = budget_bytes
        self.count = count
        self.on_layer_read = on_layer_read
        self.forget = forget
        self.chunks_dir = root / "chunks"
        self.locks_dir = root / "locks"
        self._locks: dict[str, FileLock] = {}
        self._mutex = threading.Lock()
        self._live: weakref.WeakValueDictionary[str, DiskChunkKV] = weakref.WeakValueDictionary()

    @property
    def read_only(self) -> bool:
        return self.index.read_only

    def path_for(self, key: str) -> Path:
        return self.chunks_dir / key[:2] / f"{key}{FILE_SUFFIX}"

    @contextmanager
    def lock_for(self, key: str, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
        """Hold the inter-process lock of ``key``'s prefix (raises filelock.Timeout after ``timeout``)."""
        shard = key[:2]
        with self._mutex:
            lock = self._locks.get(shard)
            if lock is None:
                make_dirs(self.locks_dir)
                lock = FileLock(self.locks_dir / f"{shard}.lock", mode=0o644)
                self._locks[shard] = lock
        with lock.acquire(timeout=timeout):
            yield

    # -- reads ---------------------------------------------------------------------------------------

    def contains(self, key: str) -> bool:
        """Whether ``key`` has a file (checked only when read)."""
        return self.path_for(key).is_file()

    def get(
        self, key: str, promote: Callable[[str, EncodedChunk], None] | None = None, promote_max_bytes: int = 0
    ) -> DiskChunkKV | None:
        """The chunk's file, its metadata checked, or None. A truncated, corrupt or foreign file is logged,
        removed and reported as a miss. ``promote`` receives the whole chunk once every layer was read, if
        its KV takes at most ``promote_max_bytes``."""
        live = self._live.get(key)
        if live is not None:
            self.count(disk_hits=1)
            self.index.touch(key)
            return live
        path = self.path_for(key)
        try:
            handle, meta, stat = open_file(path, key)
            self.check_ours(meta)
        except FileNotFoundError:
            self.count(disk_misses=1)
            return None
        except InvalidKVFile as exc:
            self.discard(key, str(exc), None)
            self.count(disk_misses=1)
            return None
        self.count(disk_hits=1)
        self.index.touch(key, adopt=(meta, stat.st_size))
        small = meta.layer_nbytes * meta.num_layers <= promote_max_bytes  # the RAM tier keeps it encoded
        read_ahead(path)  # every layer will be read, one at a time, by whoever computes
        source = DiskChunkKV(self, key, handle, meta, stat, promote if small else None)
        self._live[key] = source
        return source

    def check_ours(self, meta: FileMeta) -> None:
        check_model(meta, self.fingerprint, self.kv_dtype_name, self.shape, what="file")

    def drop_live(self, key: str | None = None) -> None:
        """Forget the open reader of ``key`` (or all), so the next get opens the file again."""
        if key is None:
            self._live.clear()
        else:
            self._live.pop(key, None)

    # -- writes --------------------------------------------------------------------------------------

    def put(self, key: str, kv: ChunkKV) -> int:
        return self.write(key, encode(key, kv, self.fingerprint, self.shape, self.codec))

    def write(self, key: str, encoded: EncodedChunk) -> int:
        """Store ``encoded`` under ``key`` atomically and index it. Returns the bytes written: 0 when
        another writer had already stored a valid file. Raises StoreError when the disk is full or
        read-only; nothing stored is changed."""
        self.require_writable(f"store chunk {key[:16]}…")
        path = self.path_for(key)
        try:
            with self.lock_for(key):
                # another process may have stored this chunk while we computed it: keep its file
                written = 0 if self._valid_header(path, key) else self._write_file(path, encoded.data())
                _, meta, stat = open_file(path, key)
                self.index.record(key, meta, stat.st_size)
        except LockTimeout:
            raise StoreError(f"timed out waiting for the writer of {key[:16]}… in {self.root}") from None
        except OSError as exc:
            raise os_error(exc, f"store chunk {key[:16]}… in", self.root) from exc
        self.count(bytes_written=written)
        self.enforce_budget(keep=key)
        return written

    def _valid_header(self, path: Path, key: str) -> bool:
        try:
            _, meta, _ = open_file(path, key)
            self.check_ours(meta)
        except (FileNotFoundError, InvalidKVFile):
            return False
        return True

    def _write_file(self, path: Path, data: bytes) -> int:
        make_dirs(path.parent)
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

    def require_writable(self, action: str) -> None:
        if self.read_only:
            raise StoreError(f"the KV store at {self.root} is read-only; cannot {action}")

    # -- removal -------------------------------------------------------------------------------------

    def delete(self, key: str, lock_timeout: float = LOCK_TIMEOUT_S) -> bool:
        """Remove ``key``'s file and row; whether a file existed (False when its lock was not had)."""
        path = self.path_for(key)
        try:
            with self.lock_for(key, lock_timeout):
                existed = path.exists()
                path.unlink(missing_ok=True)
                self.index.forget(key)
        except LockTimeout:
            return False
        except OSError as exc:
            raise os_error(exc, f"remove chunk {key[:16]}… from", self.root) from exc
        return existed

    def clear(self) -> int:
        """Remove every chunk file (of every model) and leftover temp file; returns files removed."""
        self._live.clear()
        removed = sum(self.delete(self.key_of(path)) for path in self.chunk_files())
        for temp in self.temp_files():
            temp.unlink(missing_ok=True)
        self.index.sql("DELETE FROM chunks")
        return removed

    def discard(self, key: str, reason: str, seen: os.stat_result | None) -> None:
        """Drop a bad entry so the caller recomputes it. ``seen``: the file as it was when opened; a file
        a concurrent writer has since put in its place is left alone."""
        log.warning("KV store %s: chunk %s… is unusable (%s); removed", self.root, key[:16], reason)
        self.count(corrupt=1)
        self._live.pop(key, None)
        self.forget(key)
        if self.read_only:
            return
        path = self.path_for(key)
        try:
            with self.lock_for(key):
                if seen is not None:
                    now = path.stat()
                    if (now.st_ino, now.st_mtime_ns) != (seen.st_ino, seen.st_mtime_ns):
                        return
                path.unlink(missing_ok=True)
                self.index.forget(key)
        except FileNotFoundError:
            self.index.forget(key)
        except (OSError, LockTimeout, StoreError) as exc:
            log.warning("KV store %s: could not remove bad chunk %s…: %s", self.root, key[:16], exc)

    # -- maintenance ---------------------------------------------------------------------------------

    def enforce_budget(self, keep: str | None = None) -> int:
        """Evict least recently used files until the index's bytes fit the budget; returns how many."""
        if self.read_only:
            return 0
        total = self.index.total_bytes()
        if total <= self.budget_bytes:
            return 0
        evicted = 0
        for key, size in self.index.by_last_access():
            if total <= self.budget_bytes:
                break
            if key == keep:
                continue
            # a key another process is writing right now is skipped rather than waited for
            if self.delete(key, lock_timeout=0):
                total -= size
                evicted += 1
        self.count(disk_evictions=evicted)
        if total > self.budget_bytes:
            log.warning(
                "KV store %s: %d bytes on disk exceed the budget %d", self.root, total, self.budget_bytes
            )
        return evicted

    def stale_temp_files(self, remove: bool) -> list[Path]:
        """Temp files whose key no writer holds the lock of: leftovers of a killed writer."""
        if self.read_only:  # no writer can be at work on a read-only file system
            return self.temp_files()
        stale = []
        for temp in self.temp_files():
            key = temp.name[1:].split(".", 1)[0]
            try:
                with self.lock_for(key, timeout=0):
                    if not temp.exists():
                        continue
                    stale.append(temp)
                    if remove:
                        temp.unlink(missing_ok=True)
            except LockTimeout:
                continue
        return stale

    def chunk_files(self) -> list[Path]:
        return sorted(self.chunks_dir.glob(f"??/*{FILE_SUFFIX}"))

    def temp_files(self) -> list[Path]:
        return sorted(self.chunks_dir.glob(f"??/.*{TEMP_SUFFIX}"))

    @staticmethod
    def key_of(path: Path) -> str:
        return path.name.removesuffix(FILE_SUFFIX)


def read_ahead(path: Path) -> None:
    """Ask the kernel to start reading ``path`` into the page cache now, in the background: the layer
    reads that follow find its pages there, with no thread of ours spending a core on the wait (on a CPU
    whose cores all compute, the loader reads layers when asked, see ``store.pipeline.worth_prefetching``).
    A hint only: where the platform has no ``posix_fadvise``, or it fails, reads go to the device."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except OSError as exc:
        log.debug("read-ahead of %s not taken: %s", path, exc)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def make_dirs(path: Path) -> None:
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


def os_error(exc: OSError, action: str, root: Path) -> StoreError:
    """A store error that says what a failed file operation means for the caller."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreError(f"disk full: cannot {action} {root} ({exc.strerror}); nothing stored was changed")
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return StoreError(f"the KV store at {root} is read-only: cannot {action} it ({exc.strerror})")
    return StoreError(f"cannot {action} {root}: {exc}")
