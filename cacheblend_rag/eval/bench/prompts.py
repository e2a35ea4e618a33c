"""Real RAG prompts for the deviation and throughput sections: MuSiQue questions with the chunks ``eval``
retrieves for them, over eval's persistent KV store."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...corpus.embedder import get_embedder
from ...engine import ChunkRef, Engine
from ...models.tokenizer import load_model_tokenizer
from ...settings import get_settings
from ..datasets import Dataset, load_dataset, select_cases
from ..engines import default_corpus_dir, qa_engine
from ..retrieval import EvalCorpus
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
    prompts = []
    with eval_corpus(engine, dataset, config) as corpus:
        for case in select_cases(dataset.cases, count, seed=0):
            retrieved, _ = corpus.retrieve(case, config.top_k, "qa")
            refs = [ChunkRef(r.token_ids, r.chunk_id) for r in retrieved]
            for ref in refs:
                engine.ensure_chunk_kv(ref.token_ids)
            prompts.append(RagQuestion(case.question, refs, case.case_id))
    return prompts


def eval_corpus(engine: Engine, dataset: Dataset, config: BenchConfig) -> EvalCorpus:
    """The eval corpus of ``dataset`` at the bench's chunk size, beside ``engine``'s KV store (the one
    ``eval`` retrieves from, so bench prompts hold the chunks ``eval`` retrieves)."""
    settings = get_settings()
    return EvalCorpus.open(
        default_corpus_dir(engine.store.root, dataset, config.chunk_tokens),
        load_model_tokenizer(config.model, settings.home),
        get_embedder(),
        config.chunk_tokens,
        engine.store,
        settings.chunk_context,
    )


def eval_engine(ctx: BenchContext) -> Engine:
    """An engine over the persistent KV store ``eval`` uses, with eval's QA prompt."""
    return qa_engine(ctx.model, get_settings(), ctx.config.kv_dir)


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
