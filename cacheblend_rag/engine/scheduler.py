"""Batched serving of concurrent requests that share chunks (continuous batching over the PyTorch engine).

Requests wait in one FIFO queue. A worker thread admits them in groups, as many as the decode batch has
room for (``max_batch`` rows and a budget of KV bytes); a request that does not fit waits, and nothing
behind it overtakes it. Each admitted group is fused by one engine call (:meth:`Engine.fuse_group`: each
request routed once, on the static steps or together in the layer passes, per layer one projection and
one MLP over every request's selected tokens, attention per request with its own exact mask;
``batched_fusion=False`` fuses one at a time), and every cached chunk the group uses is read once:
a chunk's layers are kept for the group from its first reader until its last user is fused, so a chunk
shared by several requests is read from the RAM or disk tier once per group. Each fused prompt then
joins the decode batch, whose KV is one buffer [rows, Hkv, capacity, d] per layer with each row at its
own position; one forward per step generates the next token of every active row (a [B, 1] query per
row, masked to that row's own slots, so padding and other rows never leak into an answer). Requests of
a round (:mod:`~cacheblend_rag.blend.round`) that joined its pass keep their prompt in the round's cache,
held once, and their rows hold only what they generate (:mod:`~cacheblend_rag.blend.context`). A row that
finishes leaves the batch at once and its slot is refilled by the next admitted request between two
decode steps.

Every answer the engine gives is served here (:meth:`Engine.submit`). Each row is a
:class:`~cacheblend_rag.engine.decode.DecodeRow`: choosing tokens (sampling, constraints, EOS and stop
strings) is written once, in :mod:`.decode`. Per request, a :class:`RequestHandle` (:mod:`.handles`)
streams :class:`TokenEvent` objects and resolves to a :class:`GenerationResult`; greedy answers equal the
one-at-a-time ones. A request can be cancelled (:meth:`RequestHandle.cancel`, e.g. when its
client went away): a waiting one leaves the queue, an active one leaves the decode batch before the next
step, freeing its slot. Submitting to a closed scheduler raises :class:`SchedulerClosedError`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from ..blend.controller import LoadingController
from ..blend.fusor import FusionRequest, FusionResult, Fusor
from ..blend.segments import Segment
from ..config import DEFAULT_BATCH_KV_BUDGET_BYTES, DEFAULT_BATCH_MAX_REQUESTS, Config
from ..errors import AdmissionError, RequestCancelledError, SchedulerClosedError
from ..models.runtime import LayerwiseModel
from ..store.keys import kv_bytes_per_token
from .base import GenerationResult
from .batch_kv import DecodeCache, SharedChunk, fusion_batches, share_chunks
from .decode import DecodeRow, decode_step
from .exit_hooks import stop_at_exit
from .handles import RequestHandle
from .queued import QueuedRequest, SchedulerStats
from .request import AdmittedRequest, GenerationRequest

log = logging.getLogger(__name__)

__all__ = ["BatchScheduler", "FusingEngine", "GenerationRequest", "RequestHandle", "SchedulerStats"]


class FusingEngine(Protocol):
    """What the scheduler needs of an engine (the PyTorch :class:`~cacheblend_rag.engine.Engine`): its
    model and the lock its forwards take, its fusor and loading controller, and one call that fuses an
    admission group."""

    model: LayerwiseModel
    fusor: Fusor
    controller: LoadingController
    eos_ids: set[int]
    forward_lock: AbstractContextManager[Any]

    def fuse_group(
        self, requests: Sequence[FusionRequest], rounds: bool = False
    ) -> list[FusionResult | Exception]: ...


class BatchScheduler:
    """Serves concurrent requests over one :class:`Engine` in batches (see the module docstring).

    ``max_batch``: most requests decoded together (the ``batch_max_requests`` setting, whose default is
    this one's). ``kv_budget_bytes``: most bytes the decode batch's KV may take, counted as rows x the
    longest row's capacity (prompt + max new tokens) x KV bytes per token in the compute dtype, which is
    exactly what its buffer allocates (the ``batch_kv_budget_bytes`` setting). ``rounds``: the
    ``batch_rounds`` setting. Transient memory is not counted:
    the one request being fused and the layers of the chunks its group still has to fuse. :meth:`submit`
    is thread-safe; use the scheduler as a context manager, or call :meth:`close`, to stop its worker.
    """

    def __init__(
        self,
        engine: FusingEngine,
        max_batch: int = DEFAULT_BATCH_MAX_REQUESTS,
        kv_budget_bytes: int = DEFAULT_BATCH_KV_BUDGET_BYTES,
        batched_fusion: bool = True,
        rounds: bool = True,
    ):
        self.engine = engine
        # fuse an admission group's prompts together (Engine.fuse_many) rather than one at a time
        self.batched_fusion = batched_fusion
        # requests of a group that read the same chunks share one blend of them (blend/round.py)
        self.rounds = rounds
        self.model = engine.model
        self.max_batch = max_batch
        self.kv_budget_bytes = kv_budget_bytes
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.kv_budget_bytes < 1:
            raise ValueError(f"kv_budget_bytes must be >= 1, got {self.kv_budget_bytes}")
        self.kv_bytes_per_token = kv_bytes_per_token(self.model.shape, self.model.dtype)
        self.stats = SchedulerStats()
        self._waiting: deque[QueuedRequest] = deque()
        self._rows: list[QueuedRequest] = []  # the decode batch: row i's KV is the cache's batch row i
        self._cache = DecodeCache(self.model)
        self._cond = threading.Condition()
        self._closing = False
        self._abandoned = False  # at exit: every request is cancelled, the one being fused included
        self._next_id = 0
        self._thread = threading.Thread(target=self._run, name="batch-scheduler", daemon=True)
        self._thread.start()
        stop_at_exit(self)  # the worker is a daemon: joined at exit if never closed

    @classmethod
    def of(cls, engine: FusingEngine, config: Config, **options: Any) -> BatchScheduler:
        """A scheduler over ``engine`` with ``config``'s batch limits (``batch_max_requests``,
        ``batch_kv_budget_bytes``, ``batch_rounds``); ``options`` not None override them."""
        limits: dict[str, Any] = {
            "max_batch": config.batch_max_requests,
            "kv_budget_bytes": config.batch_kv_budget_bytes,
            "rounds": config.batch_rounds,
        }
        limits.update({name: value for name, value in options.items() if value is not None})
        return cls(engine, **limits)

    # -- submitting ----------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue one request; returns its handle at once. Bad input (unknown method, prompt too long, a
        request that alone exceeds the KV budget) raises here."""
        return self.submit_many([request])[0]

    def generate_batch(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """:meth:`submit_many` then wait for every result, in order. The first failure is raised once all
        requests have finished."""
        handles = self.submit_many(requests)
        for handle in handles:
            handle.future.exception()  # wait for every request before raising any failure
        return [handle.result() for handle in handles]

    def submit_many(self, requests: Sequence[GenerationRequest]) -> list[RequestHandle]:
        """Queue ``requests`` at once, in order, so that they can share admission groups; returns their
        handles. All are checked before any is queued."""
        admitted = [self._admit_request(r) for r in requests]
        with self._cond:
            if self._closing:
                raise SchedulerClosedError("the scheduler is closed")
            handles = []
            for entry in admitted:
                handle = RequestHandle(self._next_id, self.cancel)
                self._next_id += 1
                self._waiting.append(QueuedRequest(handle, entry))
                handles.append(handle)
            self.stats.submitted += len(handles)
            self._cond.notify_all()
        return handles

    def _admit_request(self, request: GenerationRequest) -> AdmittedRequest:
        admitted = AdmittedRequest.of(request, self.engine.controller, self.model.shape.max_context)
        self.engine.fusor.validate(request.segments)
        prompt_tokens, max_tokens = admitted.request.prompt_tokens, admitted.max_tokens
        needed = (prompt_tokens + max_tokens) * self.kv_bytes_per_token
        if needed > self.kv_budget_bytes:
            raise AdmissionError(
                f"a request of {prompt_tokens} prompt + {max_tokens} new tokens needs {needed:,} bytes of "
                f"KV, more than the scheduler's batch KV budget of {self.kv_budget_bytes:,} bytes; raise "
                "kv_budget_bytes (setting batch_kv_budget_bytes) or lower max_tokens"
            )
        return admitted

    # -- cancelling (a client that went away frees its slot) ------------------------------------------

    def cancel(self, handle: RequestHandle) -> bool:
        """Stop a request that has not finished: a waiting request leaves the queue at once; an active one
        leaves the decode batch before the next step, freeing its slot. The handle then ends: iteration
        stops and :meth:`RequestHandle.result` raises :class:`RequestCancelledError`. Returns False when
        the request had already finished (one finishing in the step the cancel arrives in may still
        complete normally)."""
        with self._cond:
            if handle.done():
                return False
            waiting = next((p for p in self._waiting if p.handle is handle), None)
            if waiting is not None:
                self._waiting.remove(waiting)
                self._end_cancelled(waiting)
            else:
                handle.cancel_requested = True  # the worker owns the rows: it drops this one
                self._cond.notify_all()
        return True

    @property
    def waiting(self) -> int:
        """Requests queued and not yet admitted."""
        return len(self._waiting)

    @property
    def active(self) -> int:
        """Requests in the decode batch (each holds one of its ``max_batch`` slots)."""
        return len(self._rows)

    def _drop_cancelled(self) -> None:
        """Worker: end every active row whose request was cancelled, freeing its slot."""
        slots = [
            slot
            for slot, pending in enumerate(self._rows)
            if pending.handle.cancel_requested or self._abandoned
        ]
        cancelled = [self._rows[slot] for slot in slots]
        self._free_slots(slots)  # first, so that a handle that has ended holds no slot
        for pending in cancelled:
            self._end_cancelled(pending)

    def _end_cancelled(self, pending: QueuedRequest) -> None:
        if pending.handle.done():
            return
        self.stats.cancelled += 1
        message = f"request {pending.handle.request_id} was cancelled"
        pending.handle._finish(error=RequestCancelledError(message))

    # -- lifecycle -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Serve every request already submitted, then stop the worker. Later submits raise."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    def stop_at_exit(self) -> None:
        """At interpreter exit (:mod:`.exit_hooks`): cancel every request, the one being fused included,
        and join the worker before the interpreter finalizes."""
        with self._cond:
            self._closing = self._abandoned = True
            while self._waiting:
                self._end_cancelled(self._waiting.popleft())
            self._cond.notify_all()
        self._thread.join()  # it finishes the step it is in: one decode step or one group's fusion

    def __enter__(self) -> BatchScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the worker ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._rows or self._closing):
                    self._cond.wait()
                if self._closing and not (self._waiting or self._rows):
                    self._cache.release()
                    return
                group = self._admit()
            try:
                if group:
                    self._start(group)
                self._drop_cancelled()
                if self._rows:
                    self._decode_step()
                elif not self._waiting:
                    self._cache.release()  # idle: give the batch's memory back
            except Exception as exc:  # a bug must not leave callers waiting forever
                log.exception("batch scheduler step failed; failing its requests")
                for pending in [*group, *self._rows]:
                    self._fail(pending, exc)
                self._free_slots(range(len(self._rows)))

    def _batch_bytes(self, capacities: Sequence[int]) -> int:
        return len(capacities) * max(capacities) * self.kv_bytes_per_token

    def _admit(self) -> list[QueuedRequest]:
        """Pop, in FIFO order, the waiting requests that fit beside the active rows. Called under the lock."""
        group: list[QueuedRequest] = []
        capacities = [pending.capacity for pending in self._rows]
        while self._waiting and len(capacities) < self.max_batch:
            head = self._waiting[0]
            if capacities and self._batch_bytes([*capacities, head.capacity]) > self.kv_budget_bytes:
                break  # FIFO: whoever is behind the head waits too
            capacities.append(self._waiting.popleft().capacity)
            group.append(head)
        if group:
            self.stats.groups += 1
            for pending in group:
                pending.handle.group = self.stats.groups
        return group

    def _start(self, group: list[QueuedRequest]) -> None:
        """Fuse the requests of ``group`` (together, or one at a time; sharing their chunks' reads either
        way), emit each one's first token and give it a row in the decode batch unless it has already
        finished."""
        shared = share_chunks([p.admitted.request.segments for p in group])
        fusing_at = time.perf_counter()
        for pending in group:
            pending.queue_s = fusing_at - pending.handle.submitted_at
        try:
            # cancelled since its group was admitted: not worth a fusion
            live = [i for i, p in enumerate(group) if not p.handle.cancel_requested]
            # a round is blended for every request admitted with it, so that one cancelled since leaves
            # the others' answers as they would have been (its own fusion is dropped below)
            fused = list(range(len(group))) if self.rounds and self.batched_fusion else live
            fusions: dict[int, FusionResult | Exception] = {}
            sizes = [group[i].admitted.request.prompt_tokens * self.kv_bytes_per_token for i in fused]
            for batch in fusion_batches(fused, sizes, self.kv_budget_bytes):
                for part in [batch] if self.batched_fusion else [[i] for i in batch]:
                    self.stats.fusion_passes += 1
                    jobs = [self._fusion_request(group[i], shared[i]) for i in part]
                    fusions.update(zip(part, self.engine.fuse_group(jobs, self.rounds), strict=True))
        finally:
            for segments in shared:
                for segment in segments:
                    if isinstance(segment.kv, SharedChunk):
                        segment.kv.release()
        started: list[tuple[QueuedRequest, DecodeRow]] = []
        for i, pending in enumerate(group):
            fusion = fusions.get(i) if i in live else None
            try:
                if fusion is None:
                    self._end_cancelled(pending)
                elif isinstance(fusion, Exception):
                    raise fusion
                elif (row := self._first_token(pending, fusion)) is not None:
                    started.append((pending, row))
            except Exception as exc:
                log.warning("request %d failed: %s", pending.handle.request_id, exc)
                self._fail(pending, exc)
        # every first token of the group is out before the decode batch's buffer is made room in and any
        # request's KV is copied into it (a copy per request: the last request's first token would
        # otherwise wait for all the others')
        if started:
            for pending, row in started:
                assert row.prompt is not None
                pending.slots = self._cache.slots_needed(row.prompt, pending.admitted.max_tokens)
            capacities = [p.slots for p in self._rows] + [p.slots for p, _ in started]
            self._cache.reserve(len(capacities), max(capacities), keep=len(self._rows))
        for pending, row in started:
            try:
                self._take_row(pending, row)
            except Exception as exc:
                log.warning("request %d failed: %s", pending.handle.request_id, exc)
                self._fail(pending, exc)
        if started:  # the buffer and, once each, the round caches its rows read
            self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes, self._cache.nbytes)

    @staticmethod
    def _fusion_request(pending: QueuedRequest, segments: list[Segment]) -> FusionRequest:
        """What the fusor is asked for ``pending`` (its chunks' reads shared with its group's)."""
        method = pending.admitted.resolved.method
        return FusionRequest(segments, method, extra_capacity=pending.scoring_room)

    def _first_token(self, pending: QueuedRequest, fusion: FusionResult) -> DecodeRow | None:
        """The request's decode row, its first token emitted; None when that token finished it."""
        handle = pending.handle
        row = DecodeRow(self.model.tokenizer, self.engine.eos_ids, pending.admitted, emit=handle._emit)
        if pending.scoring_room:
            pending.scored = fusion
        finished = row.start(fusion)
        handle.first_token_at = row.first_token_at
        if finished:
            self._complete(pending, row)
            return None
        return row

    def _take_row(self, pending: QueuedRequest, row: DecodeRow) -> None:
        """Give a started request its row in the decode batch (its fused KV copied into the buffer)."""
        assert row.prompt is not None
        self._cache.place(len(self._rows), row.prompt)
        row.prompt = None  # its KV lives in the batch buffer now
        pending.row = row
        self._rows.append(pending)

    def _decode_step(self) -> None:
        rows = [pending.row for pending in self._rows]
        assert all(row is not None for row in rows)
        try:
            view, contexts = self._cache.view(len(rows)), self._cache.row_contexts(len(rows))
            finished = decode_step(self.model, self.engine.forward_lock, rows, view, contexts)
        except Exception as exc:
            log.exception("decode step failed; failing its %d requests", len(rows))
            for pending in self._rows:
                self._fail(pending, exc)
            self._free_slots(range(len(self._rows)))
            return
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(rows)
        self.stats.max_rows = max(self.stats.max_rows, len(rows))
        done = [(self._rows[slot], rows[slot]) for slot in finished]
        self._free_slots(finished)  # first, so that a handle that has ended holds no slot
        for pending, row in done:
            self._complete(pending, row)

    def _free_slots(self, slots: Sequence[int]) -> None:
        """Remove the rows in ``slots`` (ascending) from the decode batch."""
        for slot in reversed(slots):  # swap the last active row into each freed slot
            last = len(self._rows) - 1
            if slot != last:
                self._cache.move(last, slot)
                self._rows[slot] = self._rows[last]
            self._cache.drop(last)
            self._rows.pop()

    def _complete(self, pending: QueuedRequest, row: DecodeRow) -> None:
        try:
            result = row.result(pending.queue_s)
            if pending.scored is not None:  # after its times were taken
                with self.engine.forward_lock:
                    row.score_continuations(self.model, pending.scored, result)
                pending.scored = None
        except Exception as exc:  # its row is gone already: fail the request rather than leave it waiting
            self._fail(pending, exc)
            return
        self.stats.completed += 1
        pending.handle._finish(result)

    def _fail(self, pending: QueuedRequest, error: BaseException) -> None:
        if pending.handle.done():
            return
        self.stats.failed += 1
        pending.handle._finish(error=error)
