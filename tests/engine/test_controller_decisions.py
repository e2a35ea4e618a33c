"""With no ratio given, the loading controller picks it on every path: ``CacheBlendRAG.query``, the
frontend (what the LangChain and LlamaIndex models call) and the batch path, and each reports the
decision it applied."""

from __future__ import annotations

import json
import shutil

import pytest

from cacheblend_rag.blend import parse_method
from cacheblend_rag.blend.controller import LoadingController, Profile
from cacheblend_rag.config import DEFAULT_METHOD
from cacheblend_rag.engine import ChunkRef, Engine, SamplingParams
from cacheblend_rag.frontend import DocumentRef, PromptFrontend, text_request
from cacheblend_rag.rag import CacheBlendRAG
from cacheblend_rag.store.keys import kv_bytes_per_token_per_layer

QUESTIONS = ["Who wrote The Unwinding?", "Which organisation did the author volunteer for?"]
SAMPLING = SamplingParams(max_tokens=3)


@pytest.fixture(scope="module")
def rag_store(tmp_path_factory, sample_store):
    """This module's own copy of the sample store (its engine writes chunk KV there for every test in it)."""
    store = tmp_path_factory.mktemp("decisions") / "store"
    shutil.copytree(sample_store, store)
    return store


@pytest.fixture(scope="module")
def engine(model, rag_store):
    engine = Engine(model, store=rag_store / "kv")
    yield engine
    engine.close()


@pytest.fixture
def slow_tiers(engine, model):
    """A measured-looking profile in which loading chunk KV from either tier is far slower than
    recomputing it: the controller must raise the ratio to 1 (recompute everything)."""
    saved = engine.controller
    profile = Profile(
        model_fingerprint=model.fingerprint,
        model=model.name,
        device="cpu",
        compute_dtype="float32",
        kv_dtype=engine.store.kv_dtype_name,
        num_layers=model.num_layers,
        kv_bytes_per_token_per_layer=kv_bytes_per_token_per_layer(model.shape, engine.store.kv_dtype),
        prefill=[(256, 0.002), (4096, 0.04)],
        tier_bytes_per_s={"ram": 1e3, "disk": 1e3},
    )
    engine.controller = LoadingController(profile, r_floor=0.15)
    yield
    engine.controller = saved


def assert_controller_chose(result, ratio: float) -> None:
    decision = result.controller
    assert decision is not None and decision["profiled"] and decision["ratio"] == ratio
    assert result.method_options["ratio"] == ratio
    assert result.recompute_ratio == pytest.approx(ratio)


def test_query_frontend_and_batch_report_the_controllers_decision(engine, rag_store, slow_tiers):
    rag = CacheBlendRAG(rag_store, engine=engine)
    assert_controller_chose(rag.query(QUESTIONS[0], top_k=2, sampling=SAMPLING), 1.0)

    batch = rag.query_batch(QUESTIONS, top_k=2, sampling=SAMPLING)
    assert len(batch) == 2
    for result in batch:
        assert_controller_chose(result, 1.0)

    frontend = PromptFrontend(rag_store, engine=engine)
    chunks = rag.retrieve(QUESTIONS[0], top_k=2)
    passages = "\n\n".join(c.text for c in chunks)
    text = frontend.render_chat([{"role": "user", "content": f"{passages}\n\nQuestion: {QUESTIONS[0]}"}])
    request = text_request(text, [DocumentRef(c.text, c.chunk_id) for c in chunks], max_tokens=3)
    result = frontend.generate(request)
    assert result.reused_tokens + result.computed_tokens == result.prompt_tokens
    assert_controller_chose(result, 1.0)
    (batched,) = frontend.generate_batch([request])
    assert_controller_chose(batched, 1.0)


def test_a_given_ratio_is_used_as_is(engine, rag_store, slow_tiers):
    rag = CacheBlendRAG(rag_store, engine=engine)
    result = rag.query(QUESTIONS[0], top_k=2, ratio=0.3, sampling=SAMPLING)
    assert result.controller is None and result.method_options["ratio"] == 0.3
    (batched,) = rag.query_batch(QUESTIONS[:1], top_k=2, method="cacheblend@0.3", sampling=SAMPLING)
    assert batched.controller is None and batched.method_options["ratio"] == 0.3


def test_without_a_profile_the_floor_ratio_is_reported(engine, rag_store):
    rag = CacheBlendRAG(rag_store, engine=engine)
    saved, engine.controller = engine.controller, LoadingController(None, r_floor=0.15)
    try:
        result = rag.query(QUESTIONS[0], top_k=2, sampling=SAMPLING)
    finally:
        engine.controller = saved
    assert result.controller["ratio"] == 0.15 and not result.controller["profiled"]
    assert "no profile" in result.controller["reason"]
    assert result.method_options["ratio"] == 0.15


def test_the_default_reports_the_budget_it_chose_for_the_chunks(engine, rag_store):
    rag = CacheBlendRAG(rag_store, engine=engine)
    lengths = [len(c.token_ids) for c in rag.retrieve(QUESTIONS[0], top_k=2)]
    result = rag.query(QUESTIONS[0], top_k=2, sampling=SAMPLING)  # the default method, no ratio
    asked = parse_method(DEFAULT_METHOD).build().model_copy(update={"ratio": result.method_options["ratio"]})
    choice = asked.request_choice(lengths)
    assert result.budget == choice and choice.chunks == 2
    assert choice.mean_chunk_tokens == pytest.approx(sum(lengths) / 2, abs=0.05)
    assert result.recompute_ratio == pytest.approx(choice.ratio, abs=0.01)
    assert result.to_dict()["budget"] == choice.to_dict()  # what query --json prints
    assert json.loads(json.dumps(result.to_dict()))["budget"]["ratio"] == choice.ratio
    fixed = rag.query(QUESTIONS[0], top_k=2, method="cacheblend@0.15", sampling=SAMPLING)
    assert fixed.budget is None


def test_short_chunks_get_more_than_the_ratio_asked(engine, rag_store):
    rag = CacheBlendRAG(rag_store, engine=engine)
    chunks = rag.retrieve(QUESTIONS[0], top_k=2)
    # both chunks cut to their first 100 tokens: short for the default's budget
    segments = engine.rag_segments(
        QUESTIONS[0], [ChunkRef(tuple(c.token_ids[:100])) for c in chunks], parse_method(DEFAULT_METHOD)
    )
    low = engine.generate(segments, parse_method(DEFAULT_METHOD).build(), SAMPLING)
    assert low.budget.short and low.budget.ratio == 0.25
    assert low.recompute_ratio == pytest.approx(0.25, abs=0.01)
    high = engine.generate(segments, parse_method("cacheblend@budget=adaptive,ratio=0.6").build(), SAMPLING)
    assert high.budget.ratio == 0.7 and high.recompute_ratio == pytest.approx(0.7, abs=0.01)
