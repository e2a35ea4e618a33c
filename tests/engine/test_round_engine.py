"""Rounds through the engine: Engine.generate_round, the batch scheduler (on by default, cancellation)
and CacheBlendRAG.query_round, each agent's result reporting its round."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from cacheblend_rag.blend.fusor import FusionRequest
from cacheblend_rag.config import DEFAULT_METHOD, DEFAULT_RATIO
from cacheblend_rag.engine import Engine, SamplingParams
from cacheblend_rag.engine.prompt import ChunkRef
from cacheblend_rag.engine.scheduler import BatchScheduler, GenerationRequest
from cacheblend_rag.store.kvstore import KVStore

DATA_DIR = Path(__file__).parent.parent / "data"
SAMPLING = SamplingParams(max_tokens=8)
QUESTIONS = ["Who founded it?", "When did it happen?", "Where is it located?"]


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    store = KVStore(tmp_path_factory.mktemp("round") / "kv", model.fingerprint, model.shape)
    yield Engine(model, store=store)
    store.close()


@pytest.fixture(scope="module")
def refs(model):
    case = json.loads((DATA_DIR / "musique_24.json").read_text())[1]
    tok = model.tokenizer
    return [
        ChunkRef(
            tuple(tok(c["title"] + "\n" + c["text"], add_special_tokens=False)["input_ids"][:100]), f"p{i}"
        )
        for i, c in enumerate(case["ctxs"][:4])
    ]


def requests(engine, refs, method, questions=QUESTIONS, sampling=SAMPLING):
    return [GenerationRequest.of(engine.rag_segments(q, refs, method), method, sampling) for q in questions]


def test_generate_round_at_r1_answers_each_agent_as_alone(engine, refs):
    method = "cacheblend@ratio=1"
    results = engine.generate_round(requests(engine, refs, method))
    for question, result in zip(QUESTIONS, results, strict=True):
        alone = engine.generate(engine.rag_segments(question, refs, method), method, SAMPLING)
        assert result.token_ids == alone.token_ids
        assert result.round_requests == 3 and result.round_shared_tokens == 400
        assert result.round_recomputed_tokens == 400
        assert alone.round_requests == 0


def test_the_scheduler_blends_shared_chunks_once_by_default(engine, refs):
    batch = requests(engine, refs, "cacheblend")
    head = batch[0].segments[0]  # the template's opening, exact KV (no method recomputes it)
    assert head.exact
    engine.generate_batch(batch)  # the chunks' KV computed and stored: the next batch reads it
    results = engine.generate_batch(requests(engine, refs, "cacheblend"))
    for question, result in zip(QUESTIONS, results, strict=True):
        assert result.round_requests == 3 and result.round_shared_tokens == 400
        # the default ratio of the round's 400 cached tokens, once
        shared = math.floor(DEFAULT_RATIO * 400 + 1e-9)
        assert result.round_recomputed_tokens == shared
        # the round's recomputed tokens were recomputed for this agent too: not kept, not read from cache
        assert result.reused_tokens == 400 + len(head) - shared
        assert result.computed_tokens == result.prompt_tokens - 400 - len(head) + shared
        assert result.kv_computed_tokens == 0
        assert result.cached_tokens + result.computed_tokens == result.prompt_tokens
        # the same counts as the same request answered alone
        alone = engine.generate(engine.rag_segments(question, refs, "cacheblend"), "cacheblend", SAMPLING)
        assert (result.cached_tokens, result.computed_tokens) == (alone.cached_tokens, alone.computed_tokens)
    off = engine.generate_batch(requests(engine, refs, "cacheblend"), rounds=False)
    assert all(r.round_requests == 0 for r in off)


def test_a_round_under_the_default_reports_the_budget_its_chunks_got(engine, refs):
    """The default's budget adapts to the round's chunks (four of 100 tokens: short), and each agent
    reports the choice it would have got alone."""
    engine.generate_batch(requests(engine, refs, DEFAULT_METHOD))  # the chunks' KV stored
    results = engine.generate_round(requests(engine, refs, DEFAULT_METHOD))
    alone = engine.generate(engine.rag_segments(QUESTIONS[0], refs, DEFAULT_METHOD), DEFAULT_METHOD, SAMPLING)
    assert alone.budget is not None and alone.budget.short and alone.budget.chunks == 4
    for result in results:
        assert result.round_requests == 3 and result.budget == alone.budget
        assert result.round_recomputed_tokens == math.floor(alone.budget.ratio * 400 + 1e-9)


def test_a_round_reads_its_chunks_through_one_loader(engine, refs, monkeypatch):
    made = []
    real = engine._loader

    def counting(sources):
        made.append(len(sources))
        return real(sources)

    monkeypatch.setattr(engine, "_loader", counting)
    batch = requests(engine, refs, "cacheblend")
    results = engine.fuse_group([FusionRequest(r.segments, r.method.build()) for r in batch], rounds=True)
    assert all(result.round.requests == 3 for result in results)
    # the round's blend reads the chunks once; its members, whose chunks come from the blend, start no
    # loader of their own (each would prefetch layers nobody asks for)
    assert len(made) == 1


def _greedy_over_own_cache(model, fusion, count):
    """Greedy tokens of a fused prompt decoded over a cache of its own (the round's chunks copied in)."""
    cache, position = fusion.cache, fusion.num_tokens
    token, tokens = int(fusion.logits.argmax()), []
    for _ in range(count):
        tokens.append(token)
        logits = model.forward(torch.tensor([[token]]), torch.tensor([position]), cache)
        token, position = int(logits[0].argmax()), position + 1
    return tokens


def test_round_agents_decode_over_the_rounds_cache_held_once(engine, refs):
    sampling = SamplingParams(max_tokens=12)
    batch = requests(engine, refs, "cacheblend", sampling=sampling)
    with BatchScheduler(engine, max_batch=3, rounds=True) as scheduler:
        shared = [h.result(timeout=600) for h in scheduler.submit_many(batch)]
        peak_shared, kv_bytes = scheduler.stats.peak_kv_bytes, scheduler.kv_bytes_per_token
    fusions = engine.fuse_group([FusionRequest(r.segments, r.method.build()) for r in batch], rounds=True)
    assert all(f.context is not None for f in fusions)  # every agent joined the round's pass
    for result, fusion in zip(shared, fusions, strict=True):
        assert result.round_requests == 3
        expected = _greedy_over_own_cache(engine.model, fusion, len(result.token_ids))
        assert result.token_ids == expected  # the round's cache read in place = a copy of it
    # the round's cache once (its prompt and the agents' own tokens) + 12 slots per agent, where a copy
    # per agent would take 3 x (prompt + 12)
    prompt = max(r.prompt_tokens for r in shared)
    assert peak_shared < 2 * prompt * kv_bytes


def test_cancelling_one_agent_leaves_the_others_unchanged(engine, refs):
    long = SamplingParams(max_tokens=40)
    expected = [
        r.token_ids for r in engine.generate_round(requests(engine, refs, "cacheblend", sampling=long))
    ]
    with BatchScheduler(engine, max_batch=3, rounds=True) as scheduler:
        handles = scheduler.submit_many(requests(engine, refs, "cacheblend", sampling=long))
        next(iter(handles[1]))  # the round is fused, every agent has its first token
        assert scheduler.cancel(handles[1])
        kept = [handles[0].result(timeout=600), handles[2].result(timeout=600)]
    assert [k.token_ids for k in kept] == [expected[0], expected[2]]
    assert handles[1].cancelled


def test_query_round_over_a_corpus(tmp_path, musique_case):
    from cacheblend_rag.ingest.pipeline import ingest
    from cacheblend_rag.rag import CacheBlendRAG

    docs = tmp_path / "docs"
    docs.mkdir()
    for i, paragraph in enumerate(musique_case["paragraphs"][:3]):
        (docs / f"p{i}.txt").write_text(paragraph[:500])
    ingest([docs], tmp_path / "corpus", chunk_tokens=96)
    rag = CacheBlendRAG(tmp_path / "corpus")
    try:
        answers = rag.query_round(QUESTIONS, top_k=2, sampling=SAMPLING)
        assert len(answers) == 3 and len({tuple(a.chunk_ids) for a in answers}) == 1  # retrieved once
        assert all(a.round_requests == 3 and a.round_shared_tokens > 0 for a in answers)
        assert rag.query_round([]) == []
    finally:
        rag.close()
