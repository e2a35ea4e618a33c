"""One thread that steps vLLM's engine for every caller, so concurrent requests are batched by vLLM.

``LLMEngine.step`` is not thread-safe and returns the outputs of every running request at once. The driver
owns it: callers submit requests and read their outputs from a queue; requests submitted from several
threads (concurrent ``stream`` calls, a batch) run in the same vLLM steps. Everything else that talks to
vLLM (``collective_rpc``) takes the same lock, between steps.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ...errors import CacheBlendError, EngineClosedError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submission:
    key: str
    prompt: dict[str, Any]
    params: Any  # vllm.SamplingParams


class EngineDriver:
    """Steps ``llm_engine`` on a daemon thread while any request is pending."""

    def __init__(self, llm_engine, lock: threading.RLock) -> None:
        self._engine = llm_engine
        self._cond = threading.Condition(lock)
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._to_add: list[tuple[Submission, queue.SimpleQueue]] = []
        self._to_abort: set[str] = set()
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, submissions: Iterable[Submission]) -> queue.SimpleQueue:
        """Queue requests; their outputs arrive on the returned queue as (perf_counter time, RequestOutput),
        or an exception when vLLM failed them."""
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        with self._cond:
            if self._closed:
                raise EngineClosedError("the vLLM engine is closed")
            self._to_add.extend((s, outputs) for s in submissions)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="vllm-driver", daemon=True)
                self._thread.start()
            self._cond.notify()
        return outputs

    def abort(self, keys: Iterable[str]) -> None:
        with self._cond:
            self._to_abort.update(keys)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._queues or self._to_add or self._to_abort or self._closed):
                    self._cond.wait()
                if self._closed:
                    self._fail_all(CacheBlendError("the vLLM engine was closed while the request ran"))
                    return
                self._add_and_abort()
                if not self._queues:
                    continue
                try:
                    outputs = self._engine.step()
                except Exception as exc:  # vLLM's engine failed: every request in it is lost
                    log.exception("vLLM engine step failed")
                    self._fail_all(exc)
                    continue
                now = time.perf_counter()
                for output in outputs:
                    outputs_queue = self._queues.get(output.request_id)
                    if outputs_queue is None:
                        continue
                    outputs_queue.put((now, output))
                    if output.finished:
                        del self._queues[output.request_id]

    def _add_and_abort(self) -> None:
        for submission, outputs in self._to_add:
            try:
                self._engine.add_request(submission.key, submission.prompt, submission.params)
            except Exception as exc:  # vLLM refused this request (e.g. validation): tell its caller
                outputs.put(exc)
                continue
            self._queues[submission.key] = outputs
        self._to_add.clear()
        aborting = sorted(self._to_abort & self._queues.keys())
        if aborting:
            self._engine.abort_request(aborting)
            for key in aborting:
                del self._queues[key]
        self._to_abort.clear()

    def _fail_all(self, exc: BaseException) -> None:
        for outputs in self._queues.values():
            outputs.put(exc)
        for _, outputs in self._to_add:
            outputs.put(exc)
        self._queues.clear()
        self._to_add.clear()
