"""Cache accounting (docs/accounting.md): KV read from a tier, recomputed, and computed for this request
are three numbers; ``cached_tokens`` never counts chunk KV computed while answering."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag.engine import ChunkRef, Engine, SamplingParams
from cacheblend_rag.store.kvstore import KVStore


@pytest.fixture
def engine(model, tmp_path) -> Engine:
    return Engine(model, store=KVStore(tmp_path / "kv", model.fingerprint, model.shape, torch.float32))


def _prompt(engine: Engine, text: str):
    ids = tuple(engine.model.tokenizer(text, add_special_tokens=False)["input_ids"])
    return "Where is the library?", [ChunkRef(ids, "c0")]


def test_chunk_kv_computed_for_the_request_is_not_reported_as_read(engine):
    question, chunks = _prompt(engine, "The town library stands on Elm Street, beside the old mill.")
    chunk_tokens = len(chunks[0].token_ids)
    params = SamplingParams(max_tokens=4)

    first = engine.generate(
        engine.rag_segments(question, chunks, "cacheblend"), "cacheblend", params, ratio=0.2
    )
    # no tier held the chunk (nor the template's opening): all of it was computed for this request
    assert first.cached_tokens == first.cache_read_blended_tokens == first.cache_read_exact_tokens == 0
    assert first.kv_computed_tokens > chunk_tokens
    assert first.reused_tokens > 0  # the blend kept most of the chunk's (fresh) KV all the same

    second = engine.generate(
        engine.rag_segments(question, chunks, "cacheblend"), "cacheblend", params, ratio=0.2
    )
    assert second.kv_computed_tokens == 0
    assert 0 < second.cache_read_blended_tokens < chunk_tokens  # read from the store, some recomputed
    assert second.cache_read_exact_tokens > 0  # the template's opening, kept in memory since
    assert second.cached_tokens == second.reused_tokens
    assert second.cached_tokens + second.computed_tokens == second.prompt_tokens
    assert second.to_dict()["cached_tokens"] == second.cached_tokens


def test_full_recompute_reads_and_computes_nothing(engine):
    question, chunks = _prompt(engine, "The bakery opens at seven every morning except Sunday.")
    result = engine.generate(
        engine.rag_segments(question, chunks, "full_recompute"), "full_recompute", SamplingParams(4)
    )
    assert (result.cached_tokens, result.kv_computed_tokens) == (0, 0)
    assert result.computed_tokens == result.prompt_tokens
