"""Section ``ingest``: ingest throughput of the sample corpus and query TTFT per method on it."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...blend.spec import parse_method
from ...engine import Engine, SamplingParams
from ...errors import EvalDataError
from ...ingest import ingest
from ...rag import CacheBlendRAG
from ...records import OpenRecord
from ...settings import get_settings
from ..markdown import fmt, table
from .config import BenchConfig, BenchContext
from .page import Page

SAMPLE_CORPUS = Path(__file__).resolve().parents[3] / "examples" / "data"
QUERY_METHODS = ("full_recompute", "prefix_cache", "full_reuse", "cacheblend", "epic")


@dataclass(frozen=True)
class IngestResult(OpenRecord):
    """The ingest summary of the sample corpus (KV included), the median query TTFT per method, and
    every query's answer and numbers per method."""

    files: int
    chunks: int
    tokens: int
    kv_chunks: int
    kv_bytes: int
    stage_seconds: dict[str, float]
    work_seconds: float
    chunks_per_s: float
    tokens_per_s: float
    chunk_tokens: int
    query_ttft_median_s: dict[str, float]
    queries: dict[str, list[dict[str, Any]]]


def section_ingest(ctx: BenchContext) -> IngestResult:
    """Ingest the sample corpus (KV included) into a fresh store, then query TTFT per method."""
    config = ctx.config
    sources, questions = copy_sample_corpus(ctx, "sources")
    engine = Engine(ctx.model, ctx.work_dir / "ingest-kv", config=get_settings())
    corpus_dir = ctx.work_dir / "ingest-corpus"
    try:
        summary = ingest(
            [sources], corpus_dir, chunk_tokens=config.chunk_tokens, engine=engine, config=get_settings()
        )
        rag = CacheBlendRAG(corpus_dir, engine=engine)
        sampling = SamplingParams(max_tokens=config.query_max_new_tokens)
        queries: dict[str, list[dict[str, Any]]] = {m: [] for m in QUERY_METHODS}
        for question in questions:
            for method in QUERY_METHODS:
                # the bench's ratio for the methods that take one; the others run as they are
                spec = parse_method(method).with_ratio(config.ratio, where_taken=True)
                result = rag.query(
                    question["question"], top_k=config.top_k, method=spec.label, sampling=sampling
                )
                queries[method].append(
                    {
                        "question": question["question"],
                        "answer": result.answer,
                        "ttft_s": result.ttft_s,
                        "retrieval_s": result.retrieval_s,
                        "recompute_ratio": result.recompute_ratio,
                        "prompt_tokens": result.prompt_tokens,
                    }
                )
    finally:
        engine.store.close()
    return IngestResult(
        files=summary.files,
        chunks=summary.chunks,
        tokens=summary.tokens,
        kv_chunks=summary.kv_chunks,
        kv_bytes=summary.kv_bytes,
        stage_seconds=summary.stage_seconds,
        work_seconds=summary.work_seconds,
        chunks_per_s=summary.chunks_per_s,
        tokens_per_s=summary.tokens_per_s,
        chunk_tokens=config.chunk_tokens,
        query_ttft_median_s={
            m: statistics.median([q["ttft_s"] for q in rows]) for m, rows in queries.items()
        },
        queries=queries,
    )


def render_ingest(page: Page, ing: IngestResult) -> list[str]:
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in ing.stage_seconds.items())
    return [
        table(
            ["files", "chunks", "tokens", "KV bytes", "work (s)", "chunks/s", "tokens/s"],
            [
                [
                    ing.files,
                    ing.chunks,
                    ing.tokens,
                    ing.kv_bytes,
                    fmt(ing.work_seconds, 1),
                    fmt(ing.chunks_per_s, 2),
                    fmt(ing.tokens_per_s, 0),
                ]
            ],
        ),
        "",
        f"Stages: {stages} (work excludes loading the tokenizer, embedder and model). Query TTFT "
        "(engine TTFT as `query --json` reports it; retrieval excluded), median over the "
        f"{len(next(iter(ing.queries.values())))} sample questions:",
        "",
        table(["method", "TTFT (s)"], [[f"`{m}`", fmt(s)] for m, s in ing.query_ttft_median_s.items()]),
    ]


def copy_sample_corpus(ctx: BenchContext, name: str) -> tuple[Path, list[dict[str, Any]]]:
    """The sample corpus's files copied into ``work_dir/name`` (cut for quick runs), and its questions."""
    config = ctx.config
    if not (SAMPLE_CORPUS / "questions.json").is_file():
        raise EvalDataError(f"this section needs the sample corpus of a source checkout at {SAMPLE_CORPUS}")
    questions = json.loads((SAMPLE_CORPUS / "questions.json").read_text())
    files = sorted((SAMPLE_CORPUS / "corpus").iterdir())
    if config.ingest_files is not None:
        questions = [
            q for q in questions if Path(q["file"]).name in {f.name for f in files[: config.ingest_files]}
        ]
        files = files[: config.ingest_files]
    sources = ctx.work_dir / name
    sources.mkdir()
    for file in files:
        text = file.read_text()
        (sources / file.name).write_text(
            text if config.ingest_max_chars is None else _cut(file, text, config)
        )
    return sources, questions


def _cut(file: Path, text: str, config: BenchConfig) -> str:
    """The first ``ingest_max_chars`` characters (whole lines for JSON lines files)."""
    limit = config.ingest_max_chars or len(text)
    if file.suffix != ".jsonl":
        return text[:limit]
    kept, size = [], 0
    for line in text.splitlines(keepends=True):
        if kept and size + len(line) > limit:
            break
        kept.append(line)
        size += len(line)
    return "".join(kept)
