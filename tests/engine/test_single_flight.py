"""Chunk KV computed on first use is computed once for concurrent requests: the first request computes it,
the others wait for it and read it (engine/single_flight.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cacheblend_rag.engine import ChunkRef, Engine, SamplingParams
from cacheblend_rag.engine.single_flight import SingleFlight
from cacheblend_rag.store.kvstore import KVStore

THREADS = 4
TEXT = "The town library stands on Elm Street, beside the old mill, and opens at nine every weekday."
QUESTION = "Where is the library?"


def _run_together(count: int, target) -> list:
    """``target(i)`` on ``count`` threads started at once; their results (or exceptions) in order."""
    barrier = threading.Barrier(count)
    out: list = [None] * count

    def run(i: int) -> None:
        barrier.wait()
        try:
            out[i] = target(i)
        except Exception as exc:  # handed to the test in the thread's place
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    return out


# -- the mechanism ---------------------------------------------------------------------------------------


def test_concurrent_callers_share_one_computation():
    flight: SingleFlight[int] = SingleFlight()
    calls = []

    def compute() -> int:
        calls.append(1)
        time.sleep(0.2)  # long enough for every caller to arrive while it runs
        return 42

    results = _run_together(THREADS, lambda _: flight.run("k", compute))
    assert len(calls) == 1
    assert sorted(results) == [(42, False)] * (THREADS - 1) + [(42, True)]
    assert len(flight) == 0


def test_an_error_reaches_every_waiter_and_the_next_call_retries():
    flight: SingleFlight[int] = SingleFlight()
    calls = []

    def failing() -> int:
        calls.append(1)
        time.sleep(0.2)
        raise OSError("disk on fire")

    results = _run_together(THREADS, lambda _: flight.run("k", failing))
    assert len(calls) == 1
    assert all(isinstance(r, OSError) and str(r) == "disk on fire" for r in results)
    assert flight.run("k", lambda: 7) == (7, True)  # not remembered: computed again


def test_keys_in_opposite_orders_do_not_deadlock():
    """Two callers needing keys a and b in opposite orders over a cache (as the engine over its store),
    each computation slow: both finish, each key computed once."""
    flight: SingleFlight[str] = SingleFlight()
    cache: dict[str, str] = {}
    computed = []

    def compute(key: str) -> str:
        if key in cache:  # finished between the caller's miss and this flight
            return cache[key]
        computed.append(key)
        time.sleep(0.1)
        cache[key] = key.upper()
        return cache[key]

    def get(key: str) -> str:
        return cache[key] if key in cache else flight.run(key, lambda: compute(key))[0]

    orders = (("a", "b"), ("b", "a"))
    results = _run_together(2, lambda i: [get(k) for k in orders[i]])
    assert results == [["A", "B"], ["B", "A"]]
    assert sorted(computed) == ["a", "b"]


# -- in the engine, with a real model and store ----------------------------------------------------------


def _counting_precompute(engine: Engine) -> list[tuple[int, ...]]:
    """Count the engine's real chunk KV computations; each one slowed down so that, without single
    flight, every concurrent request would miss the store before the first has stored the chunk."""
    real = engine.precompute
    calls: list[tuple[int, ...]] = []

    def counted(token_ids, context=None):
        calls.append(tuple(token_ids))
        time.sleep(0.3)
        return real(token_ids, context)

    engine.precompute = counted  # type: ignore[method-assign]
    return calls


@pytest.fixture
def chunk(model) -> ChunkRef:
    return ChunkRef(tuple(model.tokenizer(TEXT, add_special_tokens=False)["input_ids"]), "c0")


def test_concurrent_requests_compute_a_chunk_once(model, tmp_path, chunk):
    params = SamplingParams(max_tokens=6, diagnostics=True)
    lone = Engine(model, store=KVStore(tmp_path / "lone", model.fingerprint, model.shape, "int8"))
    alone = lone.generate(lone.rag_segments(QUESTION, [chunk], "cacheblend"), "cacheblend", params, ratio=0.2)

    engine = Engine(model, store=KVStore(tmp_path / "kv", model.fingerprint, model.shape, "int8"))
    calls = _counting_precompute(engine)

    def ask(_: int):
        segments = engine.rag_segments(QUESTION, [chunk], "cacheblend")
        return engine.generate(segments, "cacheblend", params, ratio=0.2)

    results = _run_together(THREADS, ask)
    assert not [r for r in results if isinstance(r, Exception)]
    assert calls == [chunk.token_ids]  # computed once, for all of them
    assert all(r.token_ids == alone.token_ids and r.text == alone.text for r in results)
    logprobs = alone.diagnostics.first_token_logprobs
    # concurrent calls are fused in one batch by the engine's scheduler: its projections over several
    # rows sum in another order than over one, so the distribution agrees within float error
    assert all(torch.allclose(r.diagnostics.first_token_logprobs, logprobs, atol=1e-4) for r in results)
    # one request computed the chunk (and the template's opening); the others read what it computed
    head = len(engine.prompts.rag_frame(QUESTION)[0])
    assert sorted(r.kv_computed_tokens for r in results) == [0] * (THREADS - 1) + [
        head + len(chunk.token_ids)
    ]
    assert alone.kv_computed_tokens == head + len(chunk.token_ids)


def test_a_failed_computation_fails_its_waiters_and_the_next_request_computes(model, tmp_path, chunk):
    engine = Engine(model, store=KVStore(tmp_path / "kv", model.fingerprint, model.shape, "int8"))
    real = engine.precompute
    calls = []

    def failing(token_ids, context=None):
        calls.append(1)
        time.sleep(0.3)
        raise RuntimeError("out of memory")

    engine.precompute = failing  # type: ignore[method-assign]
    results = _run_together(THREADS, lambda _: engine.chunk_kv(chunk.token_ids))
    assert len(calls) == 1
    assert all(isinstance(r, RuntimeError) for r in results)

    engine.precompute = real  # type: ignore[method-assign]
    assert engine.chunk_kv(chunk.token_ids).num_tokens == len(chunk.token_ids)
    assert engine.store.contains(engine.chunk_key(chunk.token_ids))
