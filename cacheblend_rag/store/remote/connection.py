"""The remote tier's link to its server: the redis-py client, outage detection with back-off, counters."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ...errors import StoreError

log = logging.getLogger("cacheblend_rag.store.remote")

SOCKET_TIMEOUT_S = 5.0  # generous: one layer of a 512-token chunk of a 7-8B model is 2 MiB in fp16
CONNECT_TIMEOUT_S = 1.0
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
OWN_OPTIONS = ("prefix", "adhoc_ttl", "local_cache_mb")  # URL query parameters redis-py does not see
UNAVAILABLE = object()  # what a call returns while the server is down
_PIPELINE_ERROR = re.compile(r"^Command # \d+ \(.*?\) of pipeline caused error: ", re.DOTALL)


@dataclass
class RemoteCounters:
    """What one remote tier did in this process."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # values that failed a check (bytes, metadata, foreign model): served as misses
    unavailable: int = 0  # calls answered as misses (or skipped writes) because the server was down
    outages: int = 0
    errors: int = 0  # server errors that are not outages (e.g. OOM on a write)
    puts: int = 0
    bytes_written: int = 0
    layer_reads: int = 0  # layers fetched from the server
    bytes_read: int = 0
    cache_hits: int = 0  # layers served by the local LRU in front of the server

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class RemoteConnection:
    """Runs calls against the server; a connection error or timeout marks it down (one warning), after
    which calls are answered with :data:`UNAVAILABLE` without network traffic until the back-off has
    passed. Thread-safe."""

    def __init__(self, url: str) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise StoreError(
                "the remote KV tier needs the redis client: pip install 'cacheblend-rag[remote]'"
            ) from None
        server_url, self.options = split_url(url)
        self.url = redact(server_url)
        self.errors = redis.exceptions
        self.outage_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self.counters = RemoteCounters()
        self._mutex = threading.Lock()
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._backoff = BACKOFF_FIRST_S
        self._policy_checked = False
        self._warned: set[str] = set()
        try:
            # no retries inside redis-py: an outage must cost one short timeout, not several backed-off ones
            self.client = redis.Redis.from_url(
                server_url,
                socket_timeout=SOCKET_TIMEOUT_S,
                socket_connect_timeout=CONNECT_TIMEOUT_S,
                retry=Retry(NoBackoff(), 0),
            )
        except ValueError as exc:
            raise StoreError(f"bad remote KV tier URL {self.url}: {exc}") from None

    @property
    def available(self) -> bool:
        """False from a failed call until a later call succeeds."""
        return self._down_since is None

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)``; :data:`UNAVAILABLE` on an outage; a server error that is no outage (OOM, wrong
        type) is returned, not raised."""
        if self.skip():
            return UNAVAILABLE
        try:
            result = fn(self.client)
        except self.outage_errors as exc:
            self._went_down(exc)
            return UNAVAILABLE
        except self.errors.RedisError as exc:
            result = exc
        self._came_back()
        return result

    def skip(self) -> bool:
        """True (and counted) while the server is down and its back-off has not passed."""
        with self._mutex:
            if self._down_since is not None and time.monotonic() < self._retry_at:
                self.counters.unavailable += 1
                return True
        return False

    def count(self, **deltas: int) -> None:
        with self._mutex:
            for name, delta in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)

    def refused(self, what: str, exc: Exception) -> None:
        """A request the server refused (e.g. a write under OOM once only pinned chunks are left): the
        first of each kind is a warning, repeats are logged at debug level."""
        # redis-py wraps a pipeline's error as "Command # N (CMD args...) of pipeline caused error: ..."
        reason = _PIPELINE_ERROR.sub("", str(exc)) or type(exc).__name__
        kind = " ".join(reason.split()[:4])
        with self._mutex:
            self.counters.errors += 1
            first = kind not in self._warned
            self._warned.add(kind)
        level = logging.WARNING if first else logging.DEBUG
        log.log(level, "remote KV tier %s: %s: the server refused: %s", self.url, what, reason)

    def close(self) -> None:
        self.client.close()

    def _went_down(self, exc: BaseException) -> None:
        now = time.monotonic()
        with self._mutex:
            self.counters.unavailable += 1
            first = self._down_since is None
            if first:
                self._down_since = now
                self._backoff = BACKOFF_FIRST_S
                self.counters.outages += 1
            else:
                self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
            self._retry_at = now + self._backoff
        if first:
            log.warning(
                "remote KV tier %s is unavailable (%s): serving from the local tiers and recomputing "
                "missing chunks until it is back (retrying with back-off)",
                self.url,
                exc,
            )

    def _came_back(self) -> None:
        with self._mutex:
            down_since, self._down_since = self._down_since, None
            check, self._policy_checked = not self._policy_checked, True
        if down_since is not None:
            log.warning("remote KV tier %s is back after %.1f s", self.url, time.monotonic() - down_since)
        if check:
            self._check_policy()

    def _check_policy(self) -> None:
        """Warn once when the server's eviction policy could evict pinned corpus chunks."""
        try:
            policy = self.client.config_get("maxmemory-policy").get("maxmemory-policy")
        except (self.errors.RedisError, OSError):  # CONFIG may be disabled on managed servers
            return
        if isinstance(policy, bytes):
            policy = policy.decode()
        if policy and not policy.startswith("volatile") and policy != "noeviction":
            log.warning(
                "remote KV tier %s: maxmemory-policy is %s, which may evict pinned corpus chunks; "
                "use volatile-lru so that only request chunks (with a TTL) are evicted",
                self.url,
                policy,
            )


def split_url(url: str) -> tuple[str, dict[str, str]]:
    """Separate the tier's own query parameters (:data:`OWN_OPTIONS`) from the URL handed to redis-py."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise StoreError(
            f"remote KV tier URL {redact(url)!r}: expected redis://HOST:PORT/DB (or rediss://, unix://)"
        )
    query = parse_qsl(parts.query, keep_blank_values=True)
    own = {name: value for name, value in query if name in OWN_OPTIONS}
    rest = [(name, value) for name, value in query if name not in OWN_OPTIONS]
    return urlunsplit(parts._replace(query=urlencode(rest))), own


def redact(url: str) -> str:
    """The URL without its password (for logs and stats)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
