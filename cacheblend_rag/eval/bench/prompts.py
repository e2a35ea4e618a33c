"""Real RAG prompts for the deviation and throughput sections: MuSiQue questions with the chunks ``eval``
retrieves for them, over eval's persistent KV store."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...corpus.embedder import get_embedder
from ...engine import ChunkRef, Engine
from ...settings import get_settings
from ...text.chunker import Chunker
from ..datasets import load_dataset, select_cases
from ..harness import default_kv_dir, prompt_builder, retrieve_chunks
from .config import BenchConfig, BenchContext


@dataclass
class RagQuestion:
    """A question with the chunks retrieved for it (and the data set case it comes from, if any)."""

    question: str
    refs: list[ChunkRef]
    case_id: int | None = None


def rag_prompts(engine: Engine, config: BenchConfig, count: int) -> list[RagQuestion]:
    """``count`` MuSiQue questions with their top-k chunks (retrieved as in ``eval``), KV stored."""
    dataset = load_dataset(config.data)
    chunker, embedder = Chunker(engine.model.tokenizer, config.chunk_tokens), get_embedder()
    prompts = []
    for case in select_cases(dataset.cases, count, seed=0):
        retrieved, _ = retrieve_chunks(case, chunker, embedder, config.top_k, "qa")
        refs = [ChunkRef(r.token_ids) for r in retrieved]
        for ref in refs:
            engine.ensure_chunk_kv(ref.token_ids)
        prompts.append(RagQuestion(case.question, refs, case.case_id))
    return prompts


def eval_engine(ctx: BenchContext) -> Engine:
    """An engine over the persistent KV store ``eval`` uses, with eval's QA prompt."""
    kv_dir = ctx.config.kv_dir or default_kv_dir(ctx.model)
    return Engine(ctx.model, kv_dir, prompt_builder(ctx.model.tokenizer, "qa"), config=get_settings())


def overlapping_musique_requests(
    cases: Sequence[dict], tokenizer, count: int, chunks_per_request: int = 6, chunk_tokens: int = 150
) -> list[RagQuestion]:
    """``count`` MuSiQue questions (``question`` and ``ctxs`` of ``{title, text}``) whose chunk sets
    overlap: request i takes the first half of its chunks from its own case and the rest from the next
    case, so neighbouring requests share half their chunks. Each chunk is its paragraph's first
    ``chunk_tokens`` tokens."""
    if len(cases) < 2:
        raise ValueError("overlapping requests need at least two cases")
    own = (chunks_per_request + 1) // 2
    if chunks_per_request < 1 or own > min(len(c["ctxs"]) for c in cases):
        raise ValueError(f"cases have too few paragraphs for {chunks_per_request} chunks per request")

    def chunk(case: int, paragraph: int) -> ChunkRef:
        ctx = cases[case]["ctxs"][paragraph]
        ids = tokenizer(ctx["title"] + "\n" + ctx["text"], add_special_tokens=False)["input_ids"]
        return ChunkRef(tuple(ids[:chunk_tokens]), f"case{case}-p{paragraph}")

    requests = []
    for i in range(count):
        case, neighbour = i % len(cases), (i + 1) % len(cases)
        refs = [chunk(case, p) for p in range(own)]
        refs += [chunk(neighbour, p) for p in range(chunks_per_request - own)]
        requests.append(RagQuestion(cases[case]["question"], refs))
    return requests
