"""What the PyTorch engine returns for scoring fidelity (SamplingParams(diagnostics=True)): the first
token's distribution, the positions recomputed, and continuation NLLs, each checked against the fusion
computed directly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cacheblend_rag.engine import ChunkRef, Engine, GenerationRequest, SamplingParams
from cacheblend_rag.engine.metrics import continuation_nll, kl_divergence
from cacheblend_rag.store.kvstore import KVStore

DATA_DIR = Path(__file__).parent.parent / "data"


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory) -> Engine:
    store = KVStore(tmp_path_factory.mktemp("diag") / "kv", model.fingerprint, model.shape, torch.float32)
    return Engine(model, store=store)


@pytest.fixture(scope="module")
def prompt(model):
    case = json.loads((DATA_DIR / "musique_24.json").read_text())[3]
    tok = model.tokenizer
    chunks = [
        ChunkRef(tuple(tok(c["title"] + "\n" + c["text"], add_special_tokens=False)["input_ids"][:120]))
        for c in case["ctxs"][:3]
    ]
    return case["question"], chunks


def test_diagnostics_match_the_fusion(engine, prompt):
    question, chunks = prompt
    segments = engine.rag_segments(question, chunks, "cacheblend")
    fusion = engine.fuse(segments, engine_method("cacheblend"))
    result = engine.generate(segments, "cacheblend", SamplingParams(max_tokens=8, diagnostics=True))
    diagnostics = result.diagnostics
    assert diagnostics is not None
    logprobs = diagnostics.first_token_logprobs
    assert logprobs.shape == fusion.logits.shape and logprobs.dtype == torch.float32
    assert abs(float(logprobs.exp().sum()) - 1.0) < 1e-4
    assert int(logprobs.argmax()) == result.token_ids[0] == int(fusion.logits.argmax())
    assert kl_divergence(fusion.logits, logprobs) < 1e-6
    assert diagnostics.recomputed_positions == tuple(fusion.selected.tolist())
    assert 0 < len(diagnostics.recomputed_positions) < result.prompt_tokens
    assert diagnostics.compute_fraction == pytest.approx(fusion.compute_fraction)
    assert 0 < diagnostics.compute_fraction < 1 and diagnostics.fusion_s > 0
    assert diagnostics.continuation_nll == ()
    # the answer's own NLL, from the logits that chose it, equals scoring it teacher-forced afterwards
    again = engine.fuse(segments, engine_method("cacheblend"), extra_capacity=16)
    forced = continuation_nll(engine.model, again.cache, again.num_tokens, again.logits, result.token_ids)
    assert diagnostics.answer_nll == pytest.approx(forced, abs=1e-4)


def test_continuations_are_scored_under_the_methods_cache(engine, prompt):
    question, chunks = prompt
    segments = engine.rag_segments(question, chunks, "full_reuse")
    tok = engine.model.tokenizer
    gold = tuple(tok("Paris, France", add_special_tokens=False)["input_ids"])
    other = tuple(tok("the moon", add_special_tokens=False)["input_ids"])
    sampling = SamplingParams(max_tokens=6, diagnostics=True, score_continuations=(gold, other))
    result = engine.generate(segments, "full_reuse", sampling)
    scores = result.diagnostics.continuation_nll
    fusion = engine.fuse(segments, engine_method("full_reuse"), extra_capacity=16)
    expected = [
        continuation_nll(engine.model, fusion.cache, fusion.num_tokens, fusion.logits, ids)
        for ids in (gold, other)
    ]
    assert scores == pytest.approx(expected, abs=1e-4)
    assert scores[0] != pytest.approx(scores[1], abs=1e-3)
    full = engine.generate(
        engine.rag_segments(question, chunks, "full_recompute"),
        "full_recompute",
        SamplingParams(2, diagnostics=True),
    )
    assert full.diagnostics.recomputed_positions == tuple(range(full.prompt_tokens))


def test_no_diagnostics_unless_asked(engine, prompt):
    question, chunks = prompt
    segments = engine.rag_segments(question, chunks, "cacheblend")
    result = engine.generate(segments, "cacheblend", SamplingParams(max_tokens=2))
    assert result.diagnostics is None
    assert "diagnostics" not in result.to_dict()
    with pytest.raises(ValueError, match="score_continuations needs diagnostics"):
        SamplingParams(score_continuations=((1, 2),))


def test_batched_rows_report_the_first_token_distribution(engine, prompt):
    question, chunks = prompt
    segments = engine.rag_segments(question, chunks, "cacheblend")
    batched = engine.generate_batch(
        [GenerationRequest.of(segments, "cacheblend", SamplingParams(max_tokens=3, diagnostics=True))] * 2
    )
    for result in batched:
        assert result.diagnostics is not None
        assert int(result.diagnostics.first_token_logprobs.argmax()) == result.token_ids[0]
        assert abs(float(result.diagnostics.first_token_logprobs.exp().sum()) - 1.0) < 1e-4
        assert result.diagnostics.continuation_nll == ()


def engine_method(name: str):
    from cacheblend_rag.blend.spec import parse_method

    return parse_method(name).build()
