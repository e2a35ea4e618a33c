"""CacheBlendRAG.stream goes through the engine's batch scheduler, like query, query_batch and the
server: it shows up in the scheduler's counters, its tokens equal a query's, and cancelling the handle
frees its row."""

from __future__ import annotations

import pytest

from cacheblend_rag.engine import SamplingParams
from cacheblend_rag.errors import RequestCancelledError
from cacheblend_rag.rag import CacheBlendRAG
from cacheblend_rag.settings import get_settings


@pytest.fixture
def rag(rag_store):
    rag = CacheBlendRAG(rag_store, config=get_settings())
    yield rag
    rag.close()


def test_a_stream_is_submitted_to_the_scheduler_and_answers_as_a_query(rag, sample_questions):
    question = sample_questions[0]["question"]
    scheduler = rag.engine.scheduler
    queried = rag.query(question, sampling=SamplingParams(6))
    assert scheduler.stats.submitted == 1 and scheduler.stats.completed == 1  # query is a stream too
    handle = rag.stream(question, sampling=SamplingParams(6))
    assert scheduler.stats.submitted == 2  # queued at once, before any token is asked for
    tokens = "".join(event.text for event in handle)
    streamed = handle.result()
    assert handle.result() is streamed  # converted once
    assert tokens.strip() == streamed.answer == queried.answer
    assert streamed.chunk_ids == queried.chunk_ids and scheduler.stats.completed == 2


def test_cancelling_a_stream_frees_its_row(rag, sample_questions):
    scheduler = rag.engine.scheduler
    handle = rag.stream(sample_questions[0]["question"], sampling=SamplingParams(200))
    events = iter(handle)
    next(events)
    assert handle.cancel()
    with pytest.raises(RequestCancelledError):
        list(events)
    with pytest.raises(RequestCancelledError):
        handle.result()
    assert scheduler.stats.cancelled == 1 and scheduler.active == 0 and scheduler.waiting == 0
