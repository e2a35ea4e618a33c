"""One object per key in a process, held by reference count: :class:`SharedRegistry`.

Behind every process-wide share: the loaded models (:mod:`.shared`), the open chunk KV stores
(:mod:`cacheblend_rag.store.shared`) and the prompt frontends the integrations hold
(:mod:`cacheblend_rag.frontend.frontends`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class _Held(Generic[V]):
    value: V
    references: int


class SharedRegistry(Generic[K, V]):
    """Objects held by reference count, one per key. Thread-safe.

    :meth:`acquire` opens the object on first use (under the registry's lock, so a second caller waits for
    the first open instead of opening again); :meth:`release` gives one reference back, and the last one
    forgets the object and closes it with ``close`` (when the registry has one; outside the lock, so a
    slow close holds up no other key)."""

    def __init__(self, close: Callable[[V], object] | None = None) -> None:
        self._held: dict[K, _Held[V]] = {}
        self._lock = threading.Lock()
        self._close = close

    def acquire(self, key: K, open_: Callable[[], V], usable: Callable[[V], bool] = lambda v: True) -> V:
        """The object held under ``key`` (``open_()`` on first use, or when ``usable`` says the one held
        can no longer serve, e.g. closed by hand); one more reference to it."""
        with self._lock:
            held = self._held.get(key)
            if held is None or not usable(held.value):
                held = self._held[key] = _Held(open_(), 0)
            held.references += 1
            return held.value

    def release(self, value: V) -> bool:
        """Give back one reference to ``value``; True when it was the last (the object is forgotten, and
        closed when the registry closes objects). A value the registry does not hold is ignored."""
        with self._lock:
            key = next((k for k, held in self._held.items() if held.value is value), None)
            if key is None:
                return False
            held = self._held[key]
            held.references -= 1
            if held.references > 0:
                return False
            del self._held[key]
        if self._close is not None:
            self._close(value)
        return True

    def references(self) -> dict[K, int]:
        """Key -> references, of the objects held now."""
        with self._lock:
            return {key: held.references for key, held in self._held.items()}
