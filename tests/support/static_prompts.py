"""RAG prompts over the test text with each chunk's KV precomputed by the real model (the static fusion's
tests: tests/blend/test_static_fusion.py, tests/blend/test_static_graph.py)."""

from __future__ import annotations

from collections.abc import Callable

from op_counting import text_ids

from cacheblend_rag.blend import ChunkKV, Segment
from cacheblend_rag.engine.prompt import ChunkRef, PromptBuilder

# every selection kind the static steps take, each option that changes their work, and r = 1
STATIC_SPECS = (
    "cacheblend",
    "cacheblend@ratio=0.15,shift=false",
    "cacheblend_hkvd@0.15",
    "cacheblend_hkvd@ratio=0.15,signal=v",
    # two check layers: the second check corrects the chunks by the rows the first kept
    "cacheblend_hkvd@ratio=0.15,schedule=[[1,2.0],[3,1.0]]",
    "cacheblend@ratio=0.3,probe_depth=6",
    "full_reuse",
    "epic",
    "cacheblend@1",
)


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
