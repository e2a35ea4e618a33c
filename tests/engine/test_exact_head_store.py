"""The template's opening is stored like a chunk, exactly: a second engine over the same store folder (as a
second process would be) reads it instead of computing it, and answers as the first did."""

from __future__ import annotations

import torch

from cacheblend_rag.blend.segments import prefill_chunk_kv
from cacheblend_rag.engine import ChunkRef, Engine, SamplingParams

TEXT = "The bakery on Mill Road opens at seven every morning except Sunday, when it stays closed."
QUESTION = "When does the bakery open?"
PARAMS = SamplingParams(max_tokens=8, diagnostics=True)


def _answer(engine: Engine, chunk: ChunkRef):
    segments = engine.rag_segments(QUESTION, [chunk], "cacheblend")
    return segments, engine.generate(segments, "cacheblend", PARAMS, ratio=0.2)


def test_a_second_engine_reads_the_opening_and_answers_alike(model, tmp_path):
    chunk = ChunkRef(tuple(model.tokenizer(TEXT, add_special_tokens=False)["input_ids"]), "c0")
    folder = tmp_path / "kv"  # each engine opens it, int8 by default, as a new process would

    first_engine = Engine(model, store=folder)
    head_segments, first = _answer(first_engine, chunk)
    first_engine.close()
    head = len(head_segments[0])
    assert head_segments[0].exact and head > 0
    assert first.kv_computed_tokens == head + len(chunk.token_ids)
    assert first.cache_read_exact_tokens == 0

    second_engine = Engine(model, store=folder)
    segments, second = _answer(second_engine, chunk)
    second_engine.close()
    # only the question and what follows were computed; the opening counted as read from a cache
    assert second.kv_computed_tokens == 0
    assert second.cache_read_exact_tokens == head
    assert second.cached_tokens == second.reused_tokens
    assert second.cached_tokens + second.computed_tokens == second.prompt_tokens
    # the same answer, from the same exact KV: the opening is not kept in the store's int8 codec
    assert second.token_ids == first.token_ids and second.text == first.text
    logprobs = (r.diagnostics.first_token_logprobs for r in (first, second))
    assert torch.allclose(*logprobs, atol=1e-5)
    exact = prefill_chunk_kv(model, segments[0].token_ids)
    stored = segments[0].kv
    for layer in range(model.num_layers):
        assert all(torch.equal(a, b) for a, b in zip(stored.layer(layer), exact.layer(layer), strict=True))
