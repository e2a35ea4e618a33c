"""The handle of a request submitted to the :class:`~cacheblend_rag.engine.scheduler.BatchScheduler`: its
tokens as they are generated, its final result, and whether it was cancelled; and :class:`MappedStream`,
a stream handle whose result is turned into another (a RAG answer from an engine's)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Generic, TypeVar

from ..errors import RequestCancelledError
from .base import GenerationResult, StreamHandle, TokenEvent

R = TypeVar("R")

_END = object()  # closes a handle's event queue


class RequestHandle:
    """A submitted request. Iterate it for its tokens as they are generated (one consumer); :meth:`result`
    waits for the final :class:`GenerationResult` (and raises what the request failed with, e.g.
    :class:`RequestCancelledError` after :meth:`cancel`). ``canceller``: the scheduler's
    :meth:`~cacheblend_rag.engine.scheduler.BatchScheduler.cancel`."""

    def __init__(self, request_id: int, canceller: Callable[[RequestHandle], bool]) -> None:
        self.request_id = request_id
        self._canceller = canceller
        self.future: Future[GenerationResult] = Future()
        self.group: int | None = None  # admission group the request was fused in
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        # set by cancel() for a request in the decode batch: the scheduler's worker drops its row
        self.cancel_requested = False
        self._events: queue.SimpleQueue = queue.SimpleQueue()

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            event = self._events.get()
            if event is _END:
                break
            yield event
        self.future.result()  # re-raise the request's failure, if any

    def result(self, timeout: float | None = None) -> GenerationResult:
        return self.future.result(timeout)

    def cancel(self) -> bool:
        """Stop the request unless it has finished (False then; see :meth:`BatchScheduler.cancel`): a
        waiting request leaves the queue, an active one's row leaves the decode batch before the next
        step. Iteration then ends and :meth:`result` raises :class:`RequestCancelledError`."""
        return self._canceller(self)

    def done(self) -> bool:
        return self.future.done()

    @property
    def cancelled(self) -> bool:
        """Whether the request ended by :meth:`cancel`."""
        return self.future.done() and isinstance(self.future.exception(), RequestCancelledError)

    def _emit(self, event: TokenEvent) -> None:
        self._events.put(event)

    def _finish(self, result: GenerationResult | None = None, error: BaseException | None = None) -> None:
        self.finished_at = time.perf_counter()
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)
        self._events.put(_END)


class MappedStream(Generic[R]):
    """``handle``'s tokens as they come, its result turned by ``convert`` (once, on first :meth:`result`),
    and its :meth:`cancel` (from any thread): a :class:`StreamHandle` of the converted result."""

    def __init__(
        self, handle: StreamHandle[GenerationResult], convert: Callable[[GenerationResult], R]
    ) -> None:
        self.submitted_at = handle.submitted_at
        self._handle = handle
        self._convert = convert
        self._lock = threading.Lock()
        self._result: tuple[R] | None = None

    def __iter__(self) -> Iterator[TokenEvent]:
        return iter(self._handle)

    def result(self) -> R:
        with self._lock:
            if self._result is None:
                self._result = (self._convert(self._handle.result()),)
            return self._result[0]

    def cancel(self) -> bool:
        return self._handle.cancel()
