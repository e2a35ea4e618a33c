"""Question answering over an ingested store: retrieve the top chunks, fuse their KV, generate."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from .blend.methods import MethodSpec
from .engine import ChunkRef, Engine, GenerationResult, SamplingParams, TokenEvent, create_engine
from .errors import StoreError
from .retrieval.corpus import Corpus, RetrievedChunk
from .settings import get_settings


@dataclass
class QueryResult:
    """An answer with its retrieval and fusion accounting (what ``query --json`` prints)."""

    answer: str
    method: str
    ttft_s: float
    total_s: float
    retrieval_s: float
    recompute_ratio: float
    reused_tokens: int
    computed_tokens: int
    prompt_tokens: int
    chunk_ids: list[str]
    retrieval_scores: list[float]
    finish_reason: str
    method_options: dict
    controller: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class CacheBlendRAG:
    """Retrieval plus the engine over one store directory built by ``cacheblend-rag ingest``."""

    def __init__(
        self,
        store_dir: str | Path,
        engine: Engine | None = None,
        model: str | Path | None = None,
        engine_kind: str | None = None,
    ):
        """Open ``store_dir``; without an ``engine``, build one of ``engine_kind`` ("torch" or "vllm",
        default: the ``engine`` setting) over the store's model."""
        self.corpus = Corpus.open(store_dir)
        manifest = self.corpus.manifest
        if engine is None:
            recorded = manifest.model_path if Path(manifest.model_path).is_dir() else manifest.model
            engine = create_engine(engine_kind, model or recorded, store=self.corpus.kv_dir)
        self.engine = engine
        if manifest.model_fingerprint != self.engine.model.fingerprint:
            raise StoreError(
                f"{store_dir} was built with model {manifest.model!r} (fingerprint "
                f"{manifest.model_fingerprint[:12]}…) but the engine runs {self.engine.model.name!r} "
                f"({self.engine.model.fingerprint[:12]}…); ingest into a new store for this model"
            )

    def retrieve(self, question: str, top_k: int | None = None) -> list[RetrievedChunk]:
        return self.corpus.search(question, top_k or get_settings().top_k)

    def _prepare(
        self, question: str, top_k: int | None, chunk_ids: Sequence[str] | None, method: MethodSpec
    ) -> tuple[list[RetrievedChunk], list, float]:
        started = time.perf_counter()
        chunks = (
            self.corpus.get_chunks(chunk_ids) if chunk_ids is not None else self.retrieve(question, top_k)
        )
        retrieval_s = time.perf_counter() - started
        refs = [ChunkRef(c.token_ids, c.chunk_id) for c in chunks]
        return chunks, self.engine.rag_segments(question, refs, method), retrieval_s

    def query(
        self,
        question: str,
        top_k: int | None = None,
        method: str | None = None,
        ratio: float | None = None,
        chunk_ids: Sequence[str] | None = None,
        sampling: SamplingParams | None = None,
    ) -> QueryResult:
        """Answer ``question`` from the top-k retrieved chunks (or from explicit ``chunk_ids``)."""
        results: list[QueryResult] = []
        for _ in self.stream(question, top_k, method, ratio, chunk_ids, sampling, results):
            pass
        return results[0]

    def stream(
        self,
        question: str,
        top_k: int | None = None,
        method: str | None = None,
        ratio: float | None = None,
        chunk_ids: Sequence[str] | None = None,
        sampling: SamplingParams | None = None,
        results: list[QueryResult] | None = None,
    ) -> Iterator[TokenEvent]:
        """Like :meth:`query`, yielding tokens as they come; the :class:`QueryResult` is appended to
        ``results`` when given."""
        spec = MethodSpec.parse(method or get_settings().method).with_ratio(ratio)
        chunks, segments, retrieval_s = self._prepare(question, top_k, chunk_ids, spec)
        generated: list[GenerationResult] = []
        yield from self.engine.stream(segments, spec, sampling, generated)
        if results is not None:
            results.append(_query_result(generated[0], chunks, retrieval_s))


def _query_result(
    generated: GenerationResult, chunks: list[RetrievedChunk], retrieval_s: float
) -> QueryResult:
    return QueryResult(
        answer=generated.text.strip(),
        method=generated.method,
        ttft_s=generated.ttft_s,
        total_s=generated.total_s + retrieval_s,
        retrieval_s=retrieval_s,
        recompute_ratio=generated.recompute_ratio,
        reused_tokens=generated.reused_tokens,
        computed_tokens=generated.computed_tokens,
        prompt_tokens=generated.prompt_tokens,
        chunk_ids=[c.chunk_id for c in chunks],
        retrieval_scores=[round(c.score, 6) for c in chunks],
        finish_reason=generated.finish_reason,
        method_options=generated.method_options,
        controller=generated.controller,
    )
