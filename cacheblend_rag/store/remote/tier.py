"""The remote KV tier: chunk KV of one model and storage codec on a Redis/Valkey server (encoded bytes)."""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ...blend.segments import ChunkKV
from ...errors import CorruptKVError, RemoteKVUnavailableError, StoreError
from ...models.runtime import ModelShape
from ..fileformat import (
    EncodedChunk,
    FileMeta,
    InvalidKVFile,
    Parts,
    check_model,
    encode,
    layer_bytes,
    parse_metadata,
    parts_from_bytes,
)
from ..keys import check_key, resolve_codec
from . import admin
from .connection import UNAVAILABLE, RemoteConnection, RemoteCounters
from .source import META_FIELD, LayerCache, OnComplete, RemoteChunkKV, decode_meta

log = logging.getLogger("cacheblend_rag.store.remote")

DEFAULT_PREFIX = "cacheblend:kv"
DEFAULT_ADHOC_TTL_S = 7 * 24 * 3600
DEFAULT_LOCAL_CACHE_BYTES = 256 * 1024**2
PIN_CHECK_INTERVAL_S = 5.0  # at most one look at the pins marker this often (on misses)


class RedisKVTier:
    """Chunk KV on a Redis/Valkey server (layout and policies: see the package docstring); a
    :class:`~cacheblend_rag.store.tier.KVTier`.

    Thread-safe. :meth:`get` returns a :class:`RemoteChunkKV` or None; :meth:`put` writes a chunk
    (``pinned``: corpus, no TTL; else request traffic, with a TTL). Neither raises on an outage or a
    server error: the tier then reports misses and skips writes.
    """

    name = "remote"

    def __init__(
        self,
        url: str,
        model_fingerprint: str,
        shape: ModelShape,
        kv_dtype: torch.dtype | str = "float16",
        prefix: str | None = None,
        adhoc_ttl_s: int | None = None,
        local_cache_bytes: int | None = None,
    ) -> None:
        if not model_fingerprint:
            raise StoreError("the remote KV tier needs the model fingerprint (LayerwiseModel.fingerprint)")
        self.connection = RemoteConnection(url)
        options = self.connection.options
        self.url = self.connection.url
        self.fingerprint = model_fingerprint
        self.shape = shape
        self.codec = resolve_codec(kv_dtype)
        self.kv_dtype = self.codec.dtype
        self.kv_dtype_name = self.codec.name
        self.prefix = prefix or options.get("prefix", DEFAULT_PREFIX)
        try:
            self.adhoc_ttl_s = int(adhoc_ttl_s or options.get("adhoc_ttl", DEFAULT_ADHOC_TTL_S))
            if local_cache_bytes is None and "local_cache_mb" in options:
                local_cache_bytes = int(float(options["local_cache_mb"]) * 1024**2)
        except ValueError as exc:
            raise StoreError(f"remote KV tier {self.url}: bad option ({exc})") from None
        if local_cache_bytes is None:
            local_cache_bytes = DEFAULT_LOCAL_CACHE_BYTES
        if self.adhoc_ttl_s < 1 or local_cache_bytes < 0:
            raise StoreError(f"remote KV tier {self.url}: adhoc_ttl must be >= 1 s and local_cache_mb >= 0")
        self.cache = LayerCache(local_cache_bytes)
        self._live: weakref.WeakValueDictionary[str, RemoteChunkKV] = weakref.WeakValueDictionary()
        self._live_lock = threading.Lock()
        # A server restarted without persistence comes back empty, pinned corpus KV included. A marker
        # written beside the pins (outside the chunks' key space) tells: seen once, then gone, the pins
        # are gone too; misses look at it (rate-limited) and the on_pins_lost callbacks re-pin.
        self.pins_marker = f"{self.prefix}-meta:corpus-pinned"
        self._pins_expected = False
        self._pins_marked = False
        self._next_pin_check = 0.0
        self._pins_lock = threading.Lock()
        self._on_pins_lost: list[Callable[[], object]] = []
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def counters(self) -> RemoteCounters:
        return self.connection.counters

    @property
    def available(self) -> bool:
        """False from a failed call until a later call succeeds."""
        return self.connection.available

    def name_for(self, key: str) -> str:
        """The Redis key of chunk ``key``'s hash."""
        return f"{self.prefix}:{key}"

    # -- reads ---------------------------------------------------------------------------------------

    def get(self, key: str, on_complete: OnComplete | None = None) -> RemoteChunkKV | None:
        """The chunk's KV (metadata checked now, each layer when read), or None on a miss, an invalid value
        (then deleted) or an outage. While a chunk is in use, every get returns its one source."""
        if self.connection.skip():  # down: not even a source in use, whose next layer read would fail
            return None
        live = self._live.get(key)
        if live is not None:
            self.connection.count(hits=1)
            return live
        name = self.name_for(key)

        def fetch(client):
            pipe = client.pipeline(transaction=False)
            pipe.hget(name, META_FIELD)
            pipe.hlen(name)
            return pipe.execute()

        found = self.connection.call(fetch)
        if found is UNAVAILABLE:
            return None
        if isinstance(found, Exception):  # e.g. another type of value under the name
            return self._bad(key, f"unreadable ({found})")
        raw, fields = found
        if raw is None:
            self.connection.count(misses=1)
            self._check_pins()
            return None
        try:
            metadata = decode_meta(raw)
            meta = parse_metadata(metadata, key)
            check_model(meta, self.fingerprint, self.kv_dtype_name, self.shape, what="value")
            if fields != meta.num_layers + 1:
                raise InvalidKVFile(f"{fields - 1} layers stored, metadata says {meta.num_layers}")
        except InvalidKVFile as exc:
            return self._bad(key, str(exc))
        self.connection.count(hits=1)
        with self._live_lock:
            source = self._live.get(key)
            if source is None:
                source = self._live[key] = RemoteChunkKV(self, meta, metadata, on_complete)
        return source

    def read_parts(self, meta: FileMeta, layer: int) -> Parts:
        """One layer's encoded parts of a chunk found by :meth:`get`: from the local LRU, else fetched and
        checked."""
        cached = self.cache.get(meta.key, layer)
        if cached is not None:
            self.connection.count(cache_hits=1)
            return cached
        data = self.connection.call(lambda client: client.hget(self.name_for(meta.key), str(layer)))
        if data is UNAVAILABLE:
            with self._live_lock:
                self._live.pop(meta.key, None)
            message = f"remote KV tier {self.url} went down while chunk {meta.key[:16]}… was read"
            raise RemoteKVUnavailableError(meta.key, message, layer)
        try:
            if isinstance(data, Exception):
                raise InvalidKVFile(f"layer {layer} unreadable ({data})")
            if data is None:
                raise InvalidKVFile(f"layer {layer} is gone (evicted or deleted since the chunk was found)")
            kv = parts_from_bytes(data, meta, layer)
        except InvalidKVFile as exc:
            self._bad(meta.key, str(exc))
            message = f"remote KV of chunk {meta.key[:16]}… is unusable: {exc}; it was removed"
            raise CorruptKVError(meta.key, message, layer) from None
        self.connection.count(layer_reads=1, bytes_read=len(data))
        self.cache.put(meta.key, layer, kv)
        return kv

    def contains(self, key: str) -> bool:
        """Whether the server holds a value for ``key`` (unchecked; False while the tier is down)."""
        found = self.connection.call(lambda client: client.exists(self.name_for(key)))
        return found is not UNAVAILABLE and not isinstance(found, Exception) and bool(found)

    # -- writes --------------------------------------------------------------------------------------

    def pin(self, key: str) -> bool:
        """Make the server's copy of ``key`` corpus KV (its TTL removed); returns whether the server holds
        it (False too while the tier is down or when the server refused)."""
        check_key(key)
        held = self._held(key, pinned=True) is True
        if held:
            self._mark_pins()
        return held

    def on_pins_lost(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` (in a thread of its own) when the server is seen to have lost the pinned
        corpus KV (restarted without persistence): a replica re-pins its corpus from it. From then on the
        marker is also looked at every PIN_CHECK_INTERVAL_S, since a replica whose local tiers hold every
        chunk never misses on the server."""
        self._on_pins_lost.append(callback)
        with self._pins_lock:
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch_pins, name="cacheblend-pins", daemon=True)
                self._watcher.start()

    def _watch_pins(self) -> None:
        while not self._closed.wait(PIN_CHECK_INTERVAL_S):
            self._check_pins()

    def _mark_pins(self) -> None:
        if self._pins_marked:
            return
        if self.connection.call(lambda client: client.set(self.pins_marker, b"1")) is True:
            self._pins_marked = self._pins_expected = True

    def _check_pins(self) -> None:
        """On a miss: whether the pins marker this process saw is gone; then say so once and re-pin."""
        now = time.monotonic()
        with self._pins_lock:
            if now < self._next_pin_check:
                return
            self._next_pin_check = now + PIN_CHECK_INTERVAL_S
        present = self.connection.call(lambda client: client.exists(self.pins_marker))
        if present is UNAVAILABLE or isinstance(present, Exception):
            return
        if present:
            self._pins_expected = True
            return
        if not self._pins_expected:
            return
        self._pins_expected = self._pins_marked = False  # said once per loss; re-pinning marks again
        log.warning(
            "remote KV tier %s lost its pinned corpus KV (restarted without persistence?): %s",
            self.url,
            "re-pinning this node's corpus"
            if self._on_pins_lost
            else "re-pin it with `cacheblend-rag ingest --kv-remote` and give the server AOF/RDB "
            "persistence (docs/remote_kv_tier.md)",
        )
        for callback in self._on_pins_lost:
            threading.Thread(target=callback, name="cacheblend-repin", daemon=True).start()

    def put(self, key: str, kv: ChunkKV | EncodedChunk, pinned: bool = True) -> int:
        """Store ``kv`` (checked, encoded in the tier's codec; or a chunk the KV store already encoded
        for its other tiers, whose encoded bytes are sent as they are) unless the server already holds it.

        ``pinned``: corpus KV, never given a TTL (an ad-hoc copy already there is made permanent); else a
        request's KV with the ad-hoc TTL. Returns the bytes written: 0 when present, down or refused.
        Raises only for bad input (a malformed key; StoreError for KV that is not this model's).
        """
        check_key(key)
        if self._held(key, pinned) is not False:
            return 0
        if not isinstance(kv, EncodedChunk):
            kv = encode(key, kv, self.fingerprint, self.shape, self.codec)
        elif kv.metadata.get("kv_dtype") != self.kv_dtype_name or kv.fingerprint != self.fingerprint:
            raise StoreError("the encoded chunk is of another model or storage codec than the remote tier")
        values: dict[bytes | str, bytes] = {META_FIELD: json.dumps(kv.metadata).encode()}
        values.update({str(i): layer_bytes(parts) for i, parts in enumerate(kv.layers)})
        size = sum(len(value) for value in values.values())
        written = self.connection.call(lambda client: self._write(client, self.name_for(key), values, pinned))
        if written is UNAVAILABLE:
            return 0
        if isinstance(written, Exception):
            self.connection.refused(f"chunk {key[:16]}… not stored", written)
            return 0
        if written:
            self.connection.count(puts=1, bytes_written=size)
        if pinned:
            self._mark_pins()
        return size if written else 0

    def _held(self, key: str, pinned: bool) -> bool | None:
        """Whether the server holds ``key`` (with ``pinned``: made permanent first); None when it cannot
        tell (down, or a server error, which is logged)."""
        name = self.name_for(key)

        def present(client) -> bool:
            pipe = client.pipeline(transaction=False)
            if pinned:
                pipe.persist(name)  # an ad-hoc copy becomes corpus
            pipe.exists(name)
            return bool(pipe.execute()[-1])

        found = self.connection.call(present)
        if found is UNAVAILABLE:
            return None
        if isinstance(found, Exception):
            self.connection.refused(f"chunk {key[:16]}… not stored", found)
            return None
        return found

    def _write(self, client, name: str, values: dict[bytes | str, bytes], pinned: bool) -> bool:
        """Store the hash unless another writer has meanwhile (then keep theirs); whether it was written."""
        with client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(name)
                if pipe.exists(name):
                    if pinned:
                        pipe.persist(name)
                    return False
                pipe.multi()
                pipe.hset(name, mapping=values)
                if not pinned:
                    pipe.expire(name, self.adhoc_ttl_s)
                pipe.execute()
                return True
            except self.connection.errors.WatchError:  # another writer stored the chunk meanwhile
                if pinned:
                    client.persist(name)
                return False

    def delete(self, key: str) -> bool:
        """Remove the chunk from the server and the local LRU. Returns whether the server held it."""
        self.cache.drop(key)
        with self._live_lock:
            self._live.pop(key, None)
        removed = self.connection.call(lambda client: client.delete(self.name_for(key)))
        return removed is not UNAVAILABLE and not isinstance(removed, Exception) and bool(removed)

    def _bad(self, key: str, reason: str) -> None:
        """A value that must not be used: logged, counted, deleted (so it is recomputed and rewritten).
        Returns None, the miss that :meth:`get` reports."""
        log.warning("remote KV tier %s: chunk %s… is unusable (%s); removed", self.url, key[:16], reason)
        self.connection.count(corrupt=1, misses=1)
        self.delete(key)

    # -- maintenance ---------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Cheap facts, no server call: URL, prefix, availability, the local LRU, counters."""
        return {
            "url": self.url,
            "prefix": self.prefix,
            "available": self.available,
            "adhoc_ttl_s": self.adhoc_ttl_s,
            "local_cache": {
                "layers": len(self.cache),
                "bytes": self.cache.bytes,
                "budget": self.cache.budget,
            },
            "counters": self.counters.as_dict(),
        }

    def stats(self) -> dict[str, Any]:
        """:meth:`describe` plus a scan of the server (see :func:`admin.stats`). Never raises."""
        return admin.stats(self)

    def verify(self, repair: bool = False) -> admin.RemoteVerifyReport:
        """Check every byte of every chunk under the prefix (see :func:`admin.verify`)."""
        return admin.verify(self, repair)

    def gc(self) -> dict[str, int]:
        """Delete what can never be served (see :func:`admin.gc`)."""
        return admin.gc(self)

    def close(self) -> None:
        self._closed.set()
        self.connection.close()


def connect_remote(
    remote: RedisKVTier | str | None, model_fingerprint: str, shape: ModelShape, kv_dtype: torch.dtype | str
) -> RedisKVTier | None:
    """The remote tier of a KV store: the tier given (checked to match), one opened from a URL, or None
    for None or ''."""
    if not remote:
        return None
    if isinstance(remote, RedisKVTier):
        if (remote.fingerprint, remote.kv_dtype_name) != (model_fingerprint, resolve_codec(kv_dtype).name):
            raise StoreError("the remote KV tier given is for another model or storage codec")
        return remote
    return RedisKVTier(remote, model_fingerprint, shape, kv_dtype)
