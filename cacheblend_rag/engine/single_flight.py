"""One computation per key at a time: concurrent requests for a key no cache holds yet wait for the first
one's computation instead of repeating it (chunk KV computed on first use, a template's opening)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    """Runs ``compute`` once for concurrent callers of the same key.

    The first caller of a key computes; callers of that key meanwhile wait for its result (or its
    exception) and get it as theirs. Nothing is remembered afterwards: the caller keeps what it computed
    (a store), and the next call after a failure computes again. A waiter holds nothing while it waits,
    and a computation waits on no other key, so callers needing several keys in any order cannot
    deadlock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[Hashable, Future[T]] = {}

    def run(self, key: Hashable, compute: Callable[[], T]) -> tuple[T, bool]:
        """``compute()``'s value for ``key`` and whether this call computed it (False: it waited for a
        concurrent caller's computation)."""
        with self._lock:
            running = self._running.get(key)
            if running is None:
                future: Future[T] = Future()
                self._running[key] = future
        if running is not None:
            return running.result(), False
        try:
            value = compute()
        except BaseException as exc:
            self._done(key)
            future.set_exception(exc)
            raise
        self._done(key)
        future.set_result(value)
        return value, True

    def _done(self, key: Hashable) -> None:
        # forgotten before the waiters are told: a caller arriving later computes again (after a failure)
        # or, having missed the cache just before the value was stored, finds it there itself
        with self._lock:
            del self._running[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._running)


_flights: weakref.WeakKeyDictionary[object, SingleFlight] = weakref.WeakKeyDictionary()
_flights_lock = threading.Lock()


def flights_of(owner: object) -> SingleFlight:
    """The single flight shared by everyone computing into ``owner`` (a KV store: engines over one store
    in a process then compute each key once between them)."""
    with _flights_lock:
        flight = _flights.get(owner)
        if flight is None:
            flight = _flights[owner] = SingleFlight()
        return flight
