"""RAG prompts over the test text with each chunk's KV precomputed by the real model (the static fusion's
tests: tests/blend/test_static_fusion.py, tests/blend/test_static_graph.py)."""

from __future__ import annotations

from collections.abc import Callable

from op_counting import text_ids

from cacheblend_rag.blend import ChunkKV, Segment
from cacheblend_rag.engine.prompt import ChunkRef, PromptBuilder


def chunk_kv(model, ids) -> ChunkKV:
    _, cache = model.prefill(list(ids))
    n = len(ids)
    return ChunkKV(
        [k[0, :, :n].clone() for k in cache.keys],
        [v[0, :, :n].clone() for v in cache.values],
        model.fingerprint,
    )


def prompt_maker(model) -> Callable[..., list[Segment]]:
    """``make(num_chunks, chunk_tokens, question)``: consecutive pieces of the text as chunks (memoized)."""
    ids = text_ids(model)
    made: dict[tuple, list[Segment]] = {}

    def make(num_chunks: int, chunk_tokens: int, question: str = "Who founded the company?") -> list[Segment]:
        key = (num_chunks, chunk_tokens, question)
        if key not in made:
            chunks = []
            for i in range(num_chunks):
                piece = tuple(ids[i * chunk_tokens : (i + 1) * chunk_tokens])
                chunks.append(ChunkRef(piece, None, chunk_kv(model, piece)))
            made[key] = PromptBuilder(model.tokenizer).rag_segments(question, chunks)
        return made[key]

    return make
