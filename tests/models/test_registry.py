"""SharedRegistry: one object per key, opened once however many callers race, closed on the last release."""

from __future__ import annotations

import threading

from cacheblend_rag.models.registry import SharedRegistry


class Resource:
    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_one_object_per_key_closed_by_the_last_release():
    registry: SharedRegistry[str, Resource] = SharedRegistry(close=Resource.close)
    opened: list[str] = []

    def open_(name: str) -> Resource:
        opened.append(name)
        return Resource(name)

    a = registry.acquire("a", lambda: open_("a"))
    again = registry.acquire("a", lambda: open_("a"))
    b = registry.acquire("b", lambda: open_("b"))
    assert a is again and a is not b and opened == ["a", "b"]
    assert registry.references() == {"a": 2, "b": 1}
    assert registry.release(a) is False and not a.closed
    assert registry.release(a) is True and a.closed and registry.references() == {"b": 1}
    assert registry.release(a) is False  # no longer held: ignored
    fresh = registry.acquire("a", lambda: open_("a"))
    assert fresh is not a and not fresh.closed and opened == ["a", "b", "a"]


def test_an_object_no_longer_usable_is_opened_again():
    registry: SharedRegistry[str, Resource] = SharedRegistry(close=Resource.close)
    first = registry.acquire("k", lambda: Resource("k"), lambda r: not r.closed)
    first.close()  # closed by hand
    second = registry.acquire("k", lambda: Resource("k"), lambda r: not r.closed)
    assert second is not first and registry.references() == {"k": 1}


def test_without_close_the_last_release_only_forgets():
    registry: SharedRegistry[str, Resource] = SharedRegistry()
    held = registry.acquire("k", lambda: Resource("k"))
    assert registry.release(held) is True and not held.closed and registry.references() == {}


def test_racing_callers_open_once():
    registry: SharedRegistry[str, Resource] = SharedRegistry(close=Resource.close)
    opened: list[Resource] = []
    gate = threading.Barrier(8)
    got: list[Resource] = []

    def open_() -> Resource:
        opened.append(Resource("k"))
        return opened[-1]

    def caller() -> None:
        gate.wait()
        got.append(registry.acquire("k", open_))

    threads = [threading.Thread(target=caller) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(opened) == 1 and all(r is opened[0] for r in got) and registry.references() == {"k": 8}
    for r in got:
        registry.release(r)
    assert opened[0].closed and registry.references() == {}
