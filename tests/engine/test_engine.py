"""The PyTorch engine: generation against transformers, sampling, streaming, stop strings, errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from cacheblend_rag.config import DEFAULT_RATIO
from cacheblend_rag.engine import ChunkRef, Engine, SamplingParams
from cacheblend_rag.errors import ContextLengthError
from cacheblend_rag.store.kvstore import KVStore

DATA_DIR = Path(__file__).parent.parent / "data"


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory) -> Engine:
    # fp32 storage so that exactness checks compare like with like
    store = KVStore(tmp_path_factory.mktemp("engine") / "kv", model.fingerprint, model.shape, torch.float32)
    return Engine(model, store=store)


@pytest.fixture(scope="module")
def rag_chunks(model):
    case = json.loads((DATA_DIR / "musique_24.json").read_text())[2]
    tok = model.tokenizer
    chunks = [
        ChunkRef(
            tuple(tok(c["title"] + "\n" + c["text"], add_special_tokens=False)["input_ids"][:160]), f"c{i}"
        )
        for i, c in enumerate(case["ctxs"][:3])
    ]
    return case["question"], chunks


def test_greedy_matches_transformers_generate(model, engine):
    messages = [{"role": "user", "content": "List three facts about the Moon, one per line."}]
    segments = engine.chat_segments(messages)
    ids = [t for s in segments for t in s.token_ids]
    result = engine.generate(segments, "full_recompute", SamplingParams(max_tokens=32))
    with torch.inference_mode():
        expected = model.hf_model.generate(
            torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=2
        )[0, len(ids) :].tolist()
    got = result.token_ids
    # generate() continues past EOS when told not to stop; compare up to our stop
    assert got == expected[: len(got)]
    assert len(got) == 32 or expected[len(got)] in engine.eos_ids


def test_sampling_is_reproducible_with_a_seed(engine):
    segments = engine.chat_segments([{"role": "user", "content": "Write a short poem about rain."}])
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    first = engine.generate(segments, "full_recompute", params)
    second = engine.generate(segments, "full_recompute", params)
    other = engine.generate(segments, "full_recompute", SamplingParams(12, 0.9, 0.9, seed=8))
    assert first.token_ids == second.token_ids
    assert first.token_ids != other.token_ids


def test_streaming_yields_the_answer_piece_by_piece(engine):
    segments = engine.chat_segments([{"role": "user", "content": "Count from one to ten in words."}])
    handle = engine.stream(segments, "full_recompute", SamplingParams(max_tokens=24))
    pieces = [e.text for e in handle]
    results = [handle.result()]
    assert len(pieces) > 3
    assert "".join(pieces) == results[0].text
    assert results[0].ttft_s <= results[0].total_s


def test_stop_strings_end_generation(engine):
    segments = engine.chat_segments([{"role": "user", "content": "Count from one to ten in words."}])
    full = engine.generate(segments, "full_recompute", SamplingParams(max_tokens=40))
    word = full.text.split()[2]
    stopped = engine.generate(segments, "full_recompute", SamplingParams(max_tokens=40, stop=(word,)))
    assert stopped.finish_reason == "stop"
    assert word not in stopped.text
    assert full.text.startswith(stopped.text)


def test_cacheblend_at_full_ratio_answers_like_full_prefill(engine, rag_chunks):
    question, chunks = rag_chunks
    params = SamplingParams(max_tokens=24)
    full = engine.generate(engine.rag_segments(question, chunks, "full_recompute"), "full_recompute", params)
    blended = engine.generate(
        engine.rag_segments(question, chunks, "cacheblend"), "cacheblend", params, ratio=1.0
    )
    assert blended.token_ids == full.token_ids
    # every chunk token recomputed; only the template's opening, whose KV is exact, is reused
    head = len(engine.prompts.rag_frame(question)[0])
    assert blended.recompute_ratio == 1.0
    assert full.reused_tokens == 0 and blended.reused_tokens == head


def test_cacheblend_reuses_stored_chunks(engine, rag_chunks):
    question, chunks = rag_chunks
    segments = engine.rag_segments(question, chunks, "cacheblend")
    result = engine.generate(segments, "cacheblend", SamplingParams(8), ratio=0.15)
    cached = sum(len(c.token_ids) for c in chunks)
    head = len(engine.prompts.rag_frame(question)[0])  # the template's opening: exact KV, reused too
    assert result.reused_tokens == head + cached - max(1, math.floor(0.15 * cached + 1e-9))
    assert result.chunk_ids == ["c0", "c1", "c2"]
    assert all(engine.store.contains(engine.chunk_key(c.token_ids)) for c in chunks)
    assert result.controller is None  # the ratio was given


def test_controller_picks_the_ratio_when_none_is_given(engine, rag_chunks):
    question, chunks = rag_chunks
    result = engine.generate(
        engine.rag_segments(question, chunks, "cacheblend"), "cacheblend", SamplingParams(4)
    )
    decision = result.controller
    assert decision is not None and decision["ratio"] >= decision["r_floor"] == DEFAULT_RATIO
    assert result.method_options["ratio"] == decision["ratio"]
    assert decision["tier"] in ("ram", "disk")


def test_prefix_cache_answers_like_full_prefill(engine, rag_chunks):
    question, chunks = rag_chunks
    params = SamplingParams(max_tokens=16)
    full = engine.generate(engine.rag_segments(question, chunks, "full_recompute"), "full_recompute", params)
    cached = engine.generate(engine.rag_segments(question, chunks, "prefix_cache"), "prefix_cache", params)
    assert cached.reused_tokens > len(chunks[0].token_ids)
    assert cached.token_ids == full.token_ids


def test_prompt_longer_than_context_is_refused(engine):
    too_long = [ChunkRef(tuple([42] * 4000)), ChunkRef(tuple([43] * 4300))]
    with pytest.raises(ContextLengthError, match="context"):
        engine.generate(engine.rag_segments("why?", too_long, "full_recompute"), "full_recompute")


def test_empty_question_is_refused(engine, rag_chunks):
    _, chunks = rag_chunks
    with pytest.raises(ValueError, match="question is empty"):
        engine.rag_segments("   ", chunks, "cacheblend")
