"""Batched serving of concurrent requests that share chunks (continuous batching over the PyTorch engine).

Requests wait in one FIFO queue. A worker thread admits them in groups, as many as the decode batch has
room for (``max_batch`` rows and a budget of KV bytes); a request that does not fit waits, and nothing
behind it overtakes it. Each admitted group is fused together (:meth:`Engine.fuse_many`: per layer one
projection and one MLP over every request's selected tokens, attention per request with its own exact
mask; ``batched_fusion=False`` fuses one at a time), and every cached chunk the group uses is read once:
a chunk's layers are kept for the group from its first reader until its last user is fused, so a chunk
shared by several requests is read from the RAM or disk tier once per group. Each fused prompt then
joins the decode batch, whose KV is one buffer [rows, Hkv, capacity, d] per layer with each row at its
own position; one forward per step generates the next token of every active row (a [B, 1] query per
row, masked to that row's own slots, so padding and other rows never leak into an answer). Requests of
a round (:mod:`~cacheblend_rag.blend.round`) that joined its pass keep their prompt in the round's cache,
held once, and their rows hold only what they generate (:mod:`~cacheblend_rag.blend.context`). A row that
finishes leaves the batch at once and its slot is refilled by the next admitted request between two
decode steps.

Each row is a :class:`~cacheblend_rag.engine.decode.DecodeRow`, the decode state :meth:`Engine.stream`
decodes alone: choosing tokens (sampling, constraints, EOS and stop strings) is written once, in
:mod:`.decode`. Per request, a :class:`RequestHandle` (:mod:`.handles`) streams :class:`TokenEvent`
objects and resolves to the same :class:`GenerationResult` as :meth:`Engine.generate`; greedy answers
equal the one-at-a-time ones. A request can be cancelled (:meth:`RequestHandle.cancel`, e.g. when its
client went away): a waiting one leaves the queue, an active one leaves the decode batch before the next
step, freeing its slot. Submitting to a closed scheduler raises :class:`SchedulerClosedError`.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from ..blend.controller import LoadingController
from ..blend.fusor import FusionResult, Fusor
from ..blend.methods import RecomputeMethod
from ..blend.segments import Segment
from ..blend.spec import ResolvedMethod, resolve_method
from ..config import DEFAULT_BATCH_KV_BUDGET_BYTES, DEFAULT_BATCH_MAX_REQUESTS, DEFAULT_METHOD, Config
from ..errors import AdmissionError, RequestCancelledError, SchedulerClosedError
from ..models.runtime import LayerwiseModel
from ..store.keys import kv_bytes_per_token
from .base import BatchRequest, GenerationResult, Method, generation_budget
from .batch_kv import DecodeCache, SharedChunk, fusion_batches, share_chunks
from .decode import DecodeRow, decode_step
from .exit_hooks import stop_at_exit
from .handles import RequestHandle
from .sampling import SamplingParams

log = logging.getLogger(__name__)

__all__ = ["BatchRequest", "BatchScheduler", "FusingEngine", "RequestHandle", "SchedulerStats"]


class FusingEngine(Protocol):
    """What the scheduler needs of an engine (the PyTorch :class:`~cacheblend_rag.engine.Engine`): its
    model and the lock its forwards take, its fusor and loading controller, and fusing prompts alone or
    together."""

    model: LayerwiseModel
    fusor: Fusor
    controller: LoadingController
    eos_ids: set[int]
    forward_lock: AbstractContextManager[Any]

    def fuse(self, segments: list[Segment], method: RecomputeMethod) -> FusionResult: ...

    def fuse_many(
        self, requests: Sequence[tuple[list[Segment], RecomputeMethod]]
    ) -> list[FusionResult | Exception]: ...

    def fuse_round(
        self, requests: Sequence[tuple[list[Segment], RecomputeMethod]]
    ) -> list[FusionResult | Exception]: ...


@dataclass
class SchedulerStats:
    """What a :class:`BatchScheduler` has done so far."""

    submitted: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0  # requests cancelled before they finished
    groups: int = 0  # admission groups; each reads a shared chunk once
    fusion_passes: int = 0  # fusions run: one per batch fused together, one per request otherwise
    decode_steps: int = 0
    decode_rows: int = 0  # rows summed over decode steps: decode_rows / decode_steps is the mean batch
    max_rows: int = 0  # most rows decoded in one step
    peak_kv_bytes: int = 0  # largest decode-batch KV buffer allocated

    @property
    def mean_batch(self) -> float:
        return self.decode_rows / self.decode_steps if self.decode_steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean_batch": self.mean_batch}


@dataclass
class _Pending:
    handle: RequestHandle
    segments: list[Segment]
    resolved: ResolvedMethod
    sampling: SamplingParams
    prompt_tokens: int
    max_new: int
    row: DecodeRow | None = None  # its decode state, once fused
    slots: int = 0  # slots its row takes in the decode batch's buffer, once fused

    @property
    def capacity(self) -> int:
        """KV slots the request's row needs: the prompt and every token it may still feed back."""
        return self.prompt_tokens + self.max_new


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
        self._waiting: deque[_Pending] = deque()
        self._rows: list[_Pending] = []  # the decode batch: row i's KV is the cache's batch row i
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

    def submit(
        self,
        segments: list[Segment],
        method: Method = DEFAULT_METHOD,
        sampling: SamplingParams | None = None,
        **method_options,
    ) -> RequestHandle:
        """Queue one request (what :meth:`Engine.stream` takes); returns its handle at once. Bad input
        (unknown method, prompt too long, a request that alone exceeds the KV budget) raises here."""
        return self.submit_many([BatchRequest(segments, method, sampling, method_options)])[0]

    def generate_batch(self, requests: Sequence[BatchRequest]) -> list[GenerationResult]:
        """:meth:`submit_many` then wait for every result, in order. The first failure is raised once all
        requests have finished."""
        handles = self.submit_many(requests)
        for handle in handles:
            handle.future.exception()  # wait for every request before raising any failure
        return [handle.result() for handle in handles]

    def submit_many(self, requests: Sequence[BatchRequest]) -> list[RequestHandle]:
        """Queue ``requests`` at once, in order, so that they can share admission groups; returns their
        handles. All are checked before any is queued."""
        prepared = [self._prepare(r) for r in requests]
        with self._cond:
            if self._closing:
                raise SchedulerClosedError("the scheduler is closed")
            handles = []
            for segments, resolved, sampling, prompt_tokens, max_new in prepared:
                handle = RequestHandle(self._next_id, self.cancel)
                self._next_id += 1
                self._waiting.append(_Pending(handle, segments, resolved, sampling, prompt_tokens, max_new))
                handles.append(handle)
            self.stats.submitted += len(handles)
            self._cond.notify_all()
        return handles

    def _prepare(self, request: BatchRequest):
        segments = list(request.segments)
        resolved = resolve_method(request.method, segments, self.engine.controller, request.method_options)
        sampling = request.sampling or SamplingParams()
        self.engine.fusor.validate(segments)
        prompt_tokens = sum(len(s) for s in segments)
        max_new = generation_budget(
            prompt_tokens, sampling, self.model.shape.max_context, "the model's context"
        )
        needed = (prompt_tokens + max_new) * self.kv_bytes_per_token
        if needed > self.kv_budget_bytes:
            raise AdmissionError(
                f"a request of {prompt_tokens} prompt + {max_new} new tokens needs {needed:,} bytes of KV, "
                f"more than the scheduler's batch KV budget of {self.kv_budget_bytes:,} bytes; raise "
                "kv_budget_bytes (setting batch_kv_budget_bytes) or lower max_new_tokens"
            )
        return segments, resolved, sampling, prompt_tokens, max_new

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

    def _end_cancelled(self, pending: _Pending) -> None:
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

    def _admit(self) -> list[_Pending]:
        """Pop, in FIFO order, the waiting requests that fit beside the active rows. Called under the lock."""
        group: list[_Pending] = []
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

    def _start(self, group: list[_Pending]) -> None:
        """Fuse the requests of ``group`` (together, or one at a time; sharing their chunks' reads either
        way), emit each one's first token and give it a row in the decode batch unless it has already
        finished."""
        shared = share_chunks([p.segments for p in group])
        try:
            # cancelled since its group was admitted: not worth a fusion
            live = [i for i, p in enumerate(group) if not p.handle.cancel_requested]
            # a round is blended for every request admitted with it, so that one cancelled since leaves
            # the others' answers as they would have been (its own fusion is dropped below)
            fused = list(range(len(group))) if self.rounds and self.batched_fusion else live
            fusions: dict[int, FusionResult | Exception] = {}
            sizes = [group[i].prompt_tokens * self.kv_bytes_per_token for i in fused]
            for batch in fusion_batches(fused, sizes, self.kv_budget_bytes):
                jobs = [(shared[i], group[i].resolved.method) for i in batch]
                if self.batched_fusion:
                    self.stats.fusion_passes += 1
                    fuse = self.engine.fuse_round if self.rounds else self.engine.fuse_many
                    fusions.update(zip(batch, fuse(jobs), strict=True))
                    continue
                for i, job in zip(batch, jobs, strict=True):
                    self.stats.fusion_passes += 1
                    try:
                        fusions[i] = self.engine.fuse(*job)
                    except Exception as exc:  # this request fails alone
                        fusions[i] = exc
        finally:
            for segments in shared:
                for segment in segments:
                    if isinstance(segment.kv, SharedChunk):
                        segment.kv.release()
        started: list[tuple[_Pending, DecodeRow]] = []
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
                pending.slots = self._cache.slots_needed(row.prompt, pending.max_new)
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

    def _first_token(self, pending: _Pending, fusion: FusionResult) -> DecodeRow | None:
        """The request's decode row, its first token emitted; None when that token finished it."""
        handle = pending.handle
        row = DecodeRow(
            self.model.tokenizer,
            self.engine.eos_ids,
            pending.segments,
            pending.resolved,
            pending.sampling,
            pending.max_new,
            started=handle.submitted_at,
            emit=handle._emit,
        )
        finished = row.start(fusion)
        handle.first_token_at = row.first_token_at
        if finished:
            self._complete(pending, row)
            return None
        return row

    def _take_row(self, pending: _Pending, row: DecodeRow) -> None:
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

    def _complete(self, pending: _Pending, row: DecodeRow) -> None:
        try:
            result = row.result()
        except Exception as exc:  # its row is gone already: fail the request rather than leave it waiting
            self._fail(pending, exc)
            return
        self.stats.completed += 1
        pending.handle._finish(result)

    def _fail(self, pending: _Pending, error: BaseException) -> None:
        if pending.handle.done():
            return
        self.stats.failed += 1
        pending.handle._finish(error=error)
