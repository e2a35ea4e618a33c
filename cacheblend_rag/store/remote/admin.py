"""Maintenance of the remote KV tier: stats, verify (every byte) and gc (what can never be served).

Each walks the prefix with SCAN, so the server is never blocked by a full listing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from ...errors import StoreError
from ..fileformat import InvalidKVFile, parse_metadata, parts_from_bytes
from ..keys import is_chunk_key
from .connection import RemoteConnection
from .source import META_FIELD, decode_meta

log = logging.getLogger("cacheblend_rag.store.remote")


class MaintainedTier(Protocol):
    """What maintenance reads of the tier it walks (:class:`~.tier.RedisKVTier` is one; the tier calls
    these functions, so they name its needs rather than import it)."""

    connection: RemoteConnection
    url: str
    prefix: str
    fingerprint: str

    def describe(self) -> dict[str, Any]: ...

    def delete(self, key: str) -> bool: ...


@dataclass
class RemoteVerifyReport:
    """What :func:`verify` found (and, with ``repair``, deleted)."""

    checked: int = 0
    ok: int = 0
    pinned: int = 0  # of the ok chunks: without a TTL (corpus)
    adhoc: int = 0  # of the ok chunks: with a TTL (request traffic)
    corrupt: list[dict[str, str]] = field(default_factory=list)  # key + reason; deleted on repair
    stray_keys: list[str] = field(default_factory=list)  # names under the prefix that are no chunk's
    repaired: bool = False

    @property
    def clean(self) -> bool:
        return not (self.corrupt or self.stray_keys)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "clean": self.clean}


def stats(tier: MaintainedTier) -> dict[str, Any]:
    """The tier's :meth:`describe` plus: chunks under the prefix (pinned, ad-hoc, this model's), their
    payload bytes, stray keys, and the server's memory use, limit and eviction policy. Never raises:
    ``available`` says whether the server answered."""
    data = tier.describe()
    client = tier.connection.client
    totals = {"entries": 0, "pinned": 0, "adhoc": 0, "this_model": 0, "bytes": 0, "stray_keys": 0}
    try:
        memory = client.info("memory")
        for names in _scan(tier):
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.hget(name, META_FIELD)
                pipe.ttl(name)
            replies = pipe.execute(raise_on_error=False)
            for name, raw, ttl in zip(names, replies[::2], replies[1::2], strict=True):
                key = _key_of(tier, name)
                if key is None or not isinstance(raw, bytes):
                    totals["stray_keys"] += 1
                    continue
                totals["entries"] += 1
                totals["pinned" if ttl == -1 else "adhoc"] += 1
                try:
                    meta = parse_metadata(decode_meta(raw), key)
                except InvalidKVFile:
                    continue
                totals["bytes"] += meta.layer_nbytes * meta.num_layers
                totals["this_model"] += meta.model_fingerprint == tier.fingerprint
    except (tier.connection.errors.RedisError, OSError) as exc:
        return {**data, "available": False, "error": str(exc)}
    server = {key: memory.get(key) for key in ("used_memory", "maxmemory", "maxmemory_policy")}
    return {**data, "available": True, **totals, "server": server}


def verify(tier: MaintainedTier, repair: bool = False) -> RemoteVerifyReport:
    """Read every chunk under the prefix and check its metadata and every layer's crc (chunks of other
    models for self-consistency). With ``repair``, bad chunks and stray keys are deleted. Raises
    StoreError when the server cannot be reached."""
    report = RemoteVerifyReport(repaired=repair)
    try:
        for names in _scan(tier):
            for name in names:
                _verify_one(tier, name, report, repair)
    except tier.connection.outage_errors as exc:
        raise StoreError(f"remote KV tier {tier.url} is unreachable: {exc}") from None
    return report


def _verify_one(tier: MaintainedTier, name: bytes, report: RemoteVerifyReport, repair: bool) -> None:
    client = tier.connection.client
    key = _key_of(tier, name)
    if key is None:
        report.stray_keys.append(name.decode(errors="replace"))
        if repair:
            client.delete(name)
        return
    report.checked += 1
    pipe = client.pipeline(transaction=False)
    pipe.hget(name, META_FIELD)
    pipe.hlen(name)
    pipe.ttl(name)
    raw, fields, ttl = pipe.execute(raise_on_error=False)
    try:
        if not isinstance(raw, bytes):
            raise InvalidKVFile("no metadata" if raw is None else f"unreadable ({raw})")
        meta = parse_metadata(decode_meta(raw), key)
        if fields != meta.num_layers + 1:
            raise InvalidKVFile(f"{fields - 1} layers stored, metadata says {meta.num_layers}")
        for layer in range(meta.num_layers):
            data = client.hget(name, str(layer))
            if data is None:
                raise InvalidKVFile(f"layer {layer} is missing")
            parts_from_bytes(data, meta, layer)  # the crc covers the encoded bytes
    except (InvalidKVFile, tier.connection.errors.ResponseError) as exc:
        report.corrupt.append({"key": key, "reason": str(exc)})
        if repair:
            tier.delete(key)
        return
    report.ok += 1
    report.pinned += ttl == -1
    report.adhoc += ttl != -1


def gc(tier: MaintainedTier) -> dict[str, int]:
    """Delete what can never be served: chunks whose metadata is invalid (damaged, or of another layout
    version) or disagrees with their layer count, and stray keys under the prefix. Reads metadata only
    (:func:`verify` checks every byte). Raises StoreError when the server cannot be reached."""
    client = tier.connection.client
    report = {"checked": 0, "removed": 0, "stray_removed": 0}
    try:
        for names in _scan(tier):
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.hget(name, META_FIELD)
                pipe.hlen(name)
            replies = pipe.execute(raise_on_error=False)
            for name, raw, fields in zip(names, replies[::2], replies[1::2], strict=True):
                key = _key_of(tier, name)
                if key is None:
                    report["stray_removed"] += client.delete(name)
                    continue
                report["checked"] += 1
                try:
                    if not isinstance(raw, bytes):
                        raise InvalidKVFile("no metadata")
                    meta = parse_metadata(decode_meta(raw), key)
                    if fields != meta.num_layers + 1:
                        raise InvalidKVFile("layer count disagrees with the metadata")
                except InvalidKVFile as exc:
                    log.info("remote KV tier %s: removing chunk %s… (%s)", tier.url, key[:16], exc)
                    tier.delete(key)
                    report["removed"] += 1
    except tier.connection.outage_errors as exc:
        raise StoreError(f"remote KV tier {tier.url} is unreachable: {exc}") from None
    return report


def _key_of(tier: MaintainedTier, name: bytes) -> str | None:
    """The chunk key a name under the prefix stands for; None for a name that is no chunk's."""
    key = name.decode(errors="replace").removeprefix(tier.prefix + ":")
    return key if is_chunk_key(key) else None


def _scan(tier: MaintainedTier, count: int = 256) -> Iterator[list[bytes]]:
    """Names under the tier's prefix, in batches."""
    pattern = "".join(f"\\{c}" if c in "*?[]\\" else c for c in tier.prefix) + ":*"
    cursor = 0
    while True:
        cursor, names = tier.connection.client.scan(cursor, match=pattern, count=count)
        if names:
            yield names
        if cursor == 0:
            return
