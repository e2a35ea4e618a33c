"""The handle of a request submitted to the :class:`~cacheblend_rag.engine.scheduler.BatchScheduler`: its
tokens as they are generated, its final result, and whether it was cancelled."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from ..errors import RequestCancelledError
from .base import GenerationResult, TokenEvent

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
