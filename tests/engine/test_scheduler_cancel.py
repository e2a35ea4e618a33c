"""BatchScheduler.cancel: a waiting request leaves the queue, an active one leaves the decode batch and
frees its slot at once; the requests left are answered exactly as they would be alone."""

from __future__ import annotations

import pytest

from cacheblend_rag.blend.segments import Segment
from cacheblend_rag.engine import Engine, GenerationRequest, SamplingParams
from cacheblend_rag.engine.scheduler import BatchScheduler
from cacheblend_rag.errors import RequestCancelledError
from cacheblend_rag.store.kvstore import KVStore

LONG = SamplingParams(max_tokens=400)  # counting on: far more tokens than the test waits for
SHORT = SamplingParams(max_tokens=6)


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    store = KVStore(tmp_path_factory.mktemp("cancel") / "kv", model.fingerprint, model.shape)
    yield Engine(model, store=store)
    store.close()


def segments(engine: Engine, text: str) -> list[Segment]:
    return [Segment.fresh(engine.prompts.encode(text))]


def counting(engine: Engine) -> list[Segment]:
    return segments(engine, "Count from one to five hundred: 1, 2, 3, 4, 5, 6, 7,")


def test_cancelling_an_active_request_frees_its_slot(engine):
    question = segments(engine, "The capital of France is")
    alone = engine.generate(question, "full_recompute", SHORT)
    with BatchScheduler(engine, max_batch=1) as scheduler:
        long = scheduler.submit(GenerationRequest.of(counting(engine), "full_recompute", LONG))
        short = scheduler.submit(
            GenerationRequest.of(question, "full_recompute", SHORT)
        )  # waits: the only slot is taken
        events = iter(long)
        for _ in range(3):
            next(events)
        assert scheduler.active == 1 and scheduler.waiting == 1 and not short.done()
        assert scheduler.cancel(long)
        with pytest.raises(RequestCancelledError):  # the stream ends with the cancellation
            list(events)
        with pytest.raises(RequestCancelledError):
            long.result(timeout=60)
        assert long.cancelled and not short.cancelled
        # the freed slot serves the waiting request, which answers as it would alone
        assert short.result(timeout=120).text == alone.text
        assert scheduler.cancel(short) is False  # already finished: nothing to cancel
        stats = scheduler.stats
        assert (stats.cancelled, stats.completed, stats.failed) == (1, 1, 0)
        assert stats.decode_rows < LONG.max_tokens  # the long request stopped early
        assert scheduler.active == scheduler.waiting == 0


def test_cancelling_a_waiting_request_removes_it_from_the_queue(engine):
    with BatchScheduler(engine, max_batch=1) as scheduler:
        running = scheduler.submit(GenerationRequest.of(counting(engine), "full_recompute", LONG))
        waiting = scheduler.submit(GenerationRequest.of(counting(engine), "full_recompute", LONG))
        events = iter(running)
        for _ in range(2):  # from its second token on, the request holds the slot
            next(events)
        assert scheduler.cancel(waiting)
        assert waiting.done() and waiting.cancelled and waiting.group is None  # never admitted
        with pytest.raises(RequestCancelledError):
            list(waiting)  # no token was ever generated for it
        with pytest.raises(RequestCancelledError):
            waiting.result(timeout=1)
        assert scheduler.waiting == 0 and scheduler.active == 1
        assert scheduler.cancel(running)
        with pytest.raises(RequestCancelledError):
            running.result(timeout=60)
        assert scheduler.stats.cancelled == 2 and scheduler.stats.completed == 0


def test_a_cancelled_stream_handle_stops_its_row(engine):
    """``StreamHandle.cancel()`` on a scheduler's handle (what a client abandoning its stream calls): the
    row leaves the decode batch, the other request in the batch answers exactly as it would alone."""
    question = segments(engine, "The capital of France is")
    alone = engine.generate(question, "full_recompute", SHORT)
    with BatchScheduler(engine, max_batch=2) as scheduler:
        long = scheduler.submit(GenerationRequest.of(counting(engine), "full_recompute", LONG))
        events = iter(long)
        next(events)
        short = scheduler.submit(
            GenerationRequest.of(question, "full_recompute", SHORT)
        )  # decoded beside the long one
        assert short.result(timeout=120).token_ids == alone.token_ids
        assert scheduler.stats.max_rows == 2  # they did share the batch
        assert long.cancel()
        with pytest.raises(RequestCancelledError):
            list(events)
        assert not long.cancel()  # it has ended: nothing left to stop
        assert long.cancelled and scheduler.active == 0 and scheduler.waiting == 0
        assert scheduler.stats.decode_rows < LONG.max_tokens
        assert (scheduler.stats.cancelled, scheduler.stats.completed) == (1, 1)


def test_a_cancelled_engine_stream_stops_decoding(engine):
    """``Engine.stream`` submits to the engine's scheduler like every answer; cancelling its handle ends
    its row: iteration ends with RequestCancelledError and the row stops decoding. The engine's next
    answer is unaffected."""
    question = segments(engine, "The capital of France is")
    alone = engine.generate(question, "full_recompute", SHORT)
    rows_before = engine.scheduler.stats.decode_rows
    stream = engine.stream(counting(engine), "full_recompute", LONG)
    events = iter(stream)
    seen = [next(events) for _ in range(3)]
    assert len(seen) == 3
    assert stream.cancel()
    with pytest.raises(RequestCancelledError):
        list(events)
    with pytest.raises(RequestCancelledError):
        stream.result()
    assert stream.cancel() is False  # it has ended: nothing left to stop
    assert engine.scheduler.stats.decode_rows - rows_before < LONG.max_tokens  # stopped early
    assert engine.generate(question, "full_recompute", SHORT).token_ids == alone.token_ids
    finished = engine.stream(question, "full_recompute", SHORT)
    assert finished.result().token_ids == alone.token_ids
    assert finished.cancel() is False  # nothing left to stop
