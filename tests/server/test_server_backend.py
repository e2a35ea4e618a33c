"""The server's link to the core, in process: a client that goes away cancels its request through the
stream handle (its row leaves the batch), and a closed scheduler is answered as draining because the
backend catches the typed shutdown error (not a message it matches)."""

from __future__ import annotations

import time

import pytest

from cacheblend_rag.engine import GenerationRequest
from cacheblend_rag.errors import RequestCancelledError, SchedulerClosedError
from cacheblend_rag.rag import CacheBlendRAG
from cacheblend_rag.server.backend import EngineBackend
from cacheblend_rag.server.errors import APIError
from cacheblend_rag.server.protocol import GenerationSpec

QUESTION = [{"role": "user", "content": "Count from one to five hundred: 1, 2, 3,"}]


@pytest.fixture(scope="module")
def backend(served_corpus):
    backend = EngineBackend(served_corpus)
    yield backend
    backend.close()


def test_the_backend_opens_a_session_without_a_rag(backend):
    held = [*vars(backend).values(), *vars(backend.frontend).values()]
    assert not any(isinstance(value, CacheBlendRAG) for value in held)
    assert backend.session is backend.frontend.session and backend.engine is backend.session.engine
    assert backend.scheduler is backend.engine.scheduler  # the engine's one scheduler


def test_a_cancelled_request_leaves_the_batch(backend):
    scheduler = backend.scheduler
    assert scheduler is not None  # the PyTorch engine's requests meet in the batch scheduler
    short = backend.start(
        GenerationSpec(messages=QUESTION, max_tokens=4, temperature=0.0), time.perf_counter()
    )
    alone = short.result()
    running = backend.start(
        GenerationSpec(messages=QUESTION, max_tokens=400, temperature=0.0), time.perf_counter()
    )
    events = running.events()
    next(events)
    running.cancel()
    with pytest.raises(RequestCancelledError):
        list(events)
    assert scheduler.active == 0 and scheduler.waiting == 0
    assert scheduler.stats.cancelled == 1 and scheduler.stats.decode_rows < 400
    again = backend.start(
        GenerationSpec(messages=QUESTION, max_tokens=4, temperature=0.0), time.perf_counter()
    )
    assert again.result().text == alone.text  # the slot is free and answers are unchanged


def test_a_closed_scheduler_answers_draining(backend):
    backend.scheduler.close()
    with pytest.raises(SchedulerClosedError):  # the typed error the backend catches
        backend.scheduler.submit(
            GenerationRequest.of(backend.engine.chat_segments(QUESTION), "full_recompute")
        )
    with pytest.raises(APIError) as raised:
        backend.start(GenerationSpec(messages=QUESTION, max_tokens=4), time.perf_counter())
    assert raised.value.status == 503 and raised.value.code == "draining"
    assert isinstance(raised.value.__cause__, SchedulerClosedError)
