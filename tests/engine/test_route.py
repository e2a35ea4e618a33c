"""One request, one route: every way a user is served says how its prompt was fused, the static steps
serve lone requests, batches, rounds and the server alike when the fusor runs them, and a fusion builds
its plan and its static selection once. Real model, real sample corpus, real backend."""

from __future__ import annotations

import time

import pytest

from cacheblend_rag.blend import cacheblend
from cacheblend_rag.blend.plan import FusionPlan
from cacheblend_rag.config import Config
from cacheblend_rag.rag import CacheBlendRAG
from cacheblend_rag.server.backend import EngineBackend
from cacheblend_rag.server.protocol import GenerationSpec
from cacheblend_rag.settings import get_settings

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Where was the author of Hannibal and Scipio educated at?",
    "What county was Tim Dubois born in?",
    "The Unwinding author volunteered for which organisation?",
    "Who founded the company that distributed the film?",
]


def _config(fusion: str) -> Config:
    return get_settings().model_copy(update={"fusion": fusion})


@pytest.fixture(scope="module")
def static_rag(shared_rag_store):
    rag = CacheBlendRAG(shared_rag_store, config=_config("static"))
    yield rag
    rag.close()


def test_every_entry_point_reports_the_static_path(static_rag):
    rag = static_rag
    assert rag.query(QUESTIONS[0], top_k=2, max_tokens=2).fusion_path == "static"
    handle = rag.stream(QUESTIONS[1], top_k=2, max_tokens=2)
    list(handle)
    assert handle.result().fusion_path == "static"
    batch = rag.query_batch(QUESTIONS, top_k=2, max_tokens=2)
    assert [r.fusion_path for r in batch] == ["static"] * 4
    rounds = rag.query_round(QUESTIONS[:3], top_k=2, max_tokens=2)
    assert [r.fusion_path for r in rounds] == ["static"] * 3
    # a shared blend is the layer passes' (docs/fusor.md): on the static steps each is fused alone
    assert [r.round_requests for r in rounds] == [0, 0, 0]
    assert rounds[0].to_dict()["fusion_path"] == "static"


def test_the_default_on_the_cpu_reports_the_layer_passes(shared_rag_store):
    rag = CacheBlendRAG(shared_rag_store, config=_config("auto"))
    try:
        assert rag.query(QUESTIONS[0], top_k=2, max_tokens=2).fusion_path == "layers"
        assert [r.fusion_path for r in rag.query_batch(QUESTIONS[:2], top_k=2, max_tokens=2)] == [
            "layers"
        ] * 2
    finally:
        rag.close()


def test_a_chat_through_the_server_reports_its_path(shared_rag_store):
    messages = [{"role": "user", "content": "Who founded the company that distributed the film?"}]
    for fusion, expected in (("static", "static"), ("auto", "layers")):
        backend = EngineBackend(shared_rag_store, config=_config(fusion))
        try:
            chunk_ids = [c.chunk_id for c in backend.session.corpus.search(messages[0]["content"], 2)]
            spec = GenerationSpec(messages=messages, chunk_ids=chunk_ids, max_tokens=2)
            answer = backend.start(spec, time.perf_counter()).result()
            assert answer.details["fusion_path"] == expected
        finally:
            backend.close()


def test_a_fusion_builds_its_plan_and_static_selection_once(static_rag, monkeypatch):
    counts = {"plan": 0, "selection": 0}
    from_segments = FusionPlan.from_segments.__func__
    static_selection = cacheblend.CacheBlend.static_selection

    def counted_plan(cls, segments, **options):
        counts["plan"] += 1
        return from_segments(cls, segments, **options)

    def counted_selection(self, plan, num_layers):
        counts["selection"] += 1
        return static_selection(self, plan, num_layers)

    monkeypatch.setattr(FusionPlan, "from_segments", classmethod(counted_plan))
    monkeypatch.setattr(cacheblend.CacheBlend, "static_selection", counted_selection)
    assert (
        static_rag.query(QUESTIONS[0], top_k=2, max_tokens=2, method="cacheblend@0.15").fusion_path
        == "static"
    )
    assert counts == {"plan": 1, "selection": 1}
    results = static_rag.query_batch(QUESTIONS, top_k=2, max_tokens=2, method="cacheblend@0.15")
    assert {r.fusion_path for r in results} == {"static"}
    assert counts == {"plan": 5, "selection": 5}


def test_check_eval_and_bench_reach_the_fusion_through_submit(shared_rag_store, monkeypatch):
    """What the measurements call is what users are served by: a fusion entry beside the scheduler's
    fails the test, and the scheduler's submissions are counted."""
    from cacheblend_rag.blend.spec import parse_method
    from cacheblend_rag.engine import ChunkRef, Engine, SamplingParams
    from cacheblend_rag.engine.fidelity import MethodRun, compare_methods
    from cacheblend_rag.engine.scheduler import BatchScheduler
    from cacheblend_rag.eval.bench.ttft import engine_ttft

    submitted = []
    submit_many = BatchScheduler.submit_many

    def counted(self, requests):
        submitted.append(len(requests))
        return submit_many(self, requests)

    def elsewhere(*args, **kwargs):
        raise AssertionError("a fusion entry users' requests never take")

    monkeypatch.setattr(BatchScheduler, "submit_many", counted)
    monkeypatch.setattr(Engine, "fuse", elsewhere)
    rag = CacheBlendRAG(shared_rag_store, config=_config("auto"))
    try:
        report = rag.check(QUESTIONS[:1], ratios=(0.15,), max_tokens=2, top_k=2)
        assert report.rows and len(submitted) >= 2  # full prefill and the method, each submitted
        before = len(submitted)
        refs = [ChunkRef(c.token_ids, c.chunk_id) for c in rag.retrieve(QUESTIONS[1], 2)]
        runs = [
            MethodRun(label, parse_method(label), rag.engine)
            for label in ("full_recompute", "cacheblend@0.15")
        ]
        compare_methods(runs, QUESTIONS[1], refs, SamplingParams(max_tokens=2))
        assert len(submitted) == before + 2
        engine_ttft(rag.engine, QUESTIONS[1], refs, "cacheblend_ram", 0.15)
        assert len(submitted) == before + 3
    finally:
        rag.close()
