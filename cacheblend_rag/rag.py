"""Question answering over an ingested corpus: retrieve the top chunks, fuse their KV, generate."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .blend.budget_choice import BudgetChoice
from .blend.spec import MethodSpec
from .config import DECISIVE_MARGIN, DEFAULT_CHECK_MAX_TOKENS, Config
from .corpus.corpus import Corpus, RetrievedChunk
from .engine import (
    BatchRequest,
    ChunkRef,
    EngineProtocol,
    GenerationResult,
    SamplingParams,
    StreamHandle,
)
from .engine.base import PromptAccounting
from .engine.bounds import check_request
from .engine.handles import MappedStream
from .engine.session import Session
from .settings import get_settings

if TYPE_CHECKING:
    from .check import CheckReport

log = logging.getLogger(__name__)


@dataclass
class QueryResult(PromptAccounting):
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
    controller: dict | None = None  # the loading controller's decision, when it chose the ratio
    budget: BudgetChoice | None = None  # what the method's budget chose for this request's chunks, if any


@dataclass
class _Prepared:
    chunks: list[RetrievedChunk]
    segments: list
    retrieval_s: float

    def result(self, generated: GenerationResult) -> QueryResult:
        chunks = self.chunks
        return QueryResult(
            answer=generated.text.strip(),
            method=generated.method,
            ttft_s=generated.ttft_s,
            total_s=generated.total_s + self.retrieval_s,
            retrieval_s=self.retrieval_s,
            recompute_ratio=generated.recompute_ratio,
            reused_tokens=generated.reused_tokens,
            computed_tokens=generated.computed_tokens,
            prompt_tokens=generated.prompt_tokens,
            chunk_ids=[c.chunk_id for c in chunks],
            retrieval_scores=[round(c.score, 6) for c in chunks],
            finish_reason=generated.finish_reason,
            method_options=generated.method_options,
            controller=generated.controller,
            budget=generated.budget,
            **generated.accounting(),
        )


class CacheBlendRAG:
    """Retrieval plus an engine over one corpus directory built by ``cacheblend-rag ingest``.

    ``method`` (a name or spec, default the settings') and ``ratio`` (the recompute ratio of a method
    that has one) are per call; without a ratio the engine's loading controller chooses it, and results
    report its decision in ``controller``. ``config``: the values to run with (default: the process's
    settings, ``CACHEBLEND_*``); what is not given per call comes from it."""

    def __init__(
        self,
        corpus_dir: str | Path | Corpus | Session,
        engine: EngineProtocol | str | None = None,
        model: str | Path | None = None,
        engine_kind: str | None = None,
        config: Config | None = None,
    ):
        """Open the corpus at ``corpus_dir`` (or use an opened :class:`Corpus`, or the corpus and engine of
        a :class:`~cacheblend_rag.engine.session.Session`, which stays its holder's). ``engine``: an engine
        over the corpus's model, or the kind of engine to build over it ("torch" or "vllm"; also accepted
        as ``engine_kind``; default: the ``engine`` setting), built over the corpus's KV store
        (:attr:`Corpus.kv_store`, which every CacheBlendRAG over the directory in the process shares). The
        corpus and engine are checked to belong together once, by the session. What was opened or built
        here is given back by :meth:`close`."""
        if isinstance(engine, str):
            if engine_kind is not None and engine_kind != engine:
                raise ValueError(f"engine={engine!r} and engine_kind={engine_kind!r} disagree")
            engine, engine_kind = None, engine
        self.config = get_settings() if config is None else config
        if isinstance(corpus_dir, Session):
            if engine is not None or engine_kind is not None or model is not None:
                raise ValueError("a session brings its engine: pass no engine, engine_kind or model with it")
            self.session, self._owned_session = corpus_dir, False
            return
        self.session = Session.open(corpus_dir, engine_kind, model, self.config, engine=engine)
        self._owned_session = True

    @property
    def corpus(self) -> Corpus:
        return self.session.corpus

    @property
    def engine(self) -> EngineProtocol:
        return self.session.engine

    def close(self) -> None:
        """Close the engine this object built (its hold on the shared model) and the corpus it opened (its
        hold on the corpus's KV store: the last holder in the process closes it); a session given is its
        holder's to close."""
        if self._owned_session:
            self.session.close()

    def retrieve(self, question: str, top_k: int | None = None) -> list[RetrievedChunk]:
        """The ``top_k`` chunks nearest ``question`` (None: the ``top_k`` setting; 0 is refused)."""
        return self.corpus.search(question, self.config.top_k if top_k is None else top_k)

    def query(
        self,
        question: str,
        top_k: int | None = None,
        method: str | None = None,
        ratio: float | None = None,
        chunk_ids: Sequence[str] | None = None,
        sampling: SamplingParams | None = None,
        max_tokens: int | None = None,
    ) -> QueryResult:
        """Answer ``question`` from the top-k retrieved chunks (or from explicit ``chunk_ids``: an empty
        list is refused, it would answer from no passage at all). ``max_tokens``: most tokens of the
        answer (default: the ``max_tokens`` setting, 256 unless set; it overrides ``sampling``'s
        ``max_new_tokens`` when both are given)."""
        return self.stream(question, top_k, method, ratio, chunk_ids, sampling, max_tokens).result()

    def stream(
        self,
        question: str,
        top_k: int | None = None,
        method: str | None = None,
        ratio: float | None = None,
        chunk_ids: Sequence[str] | None = None,
        sampling: SamplingParams | None = None,
        max_tokens: int | None = None,
    ) -> StreamHandle[QueryResult]:
        """Like :meth:`query`; iterate the handle for tokens as they come, then ``.result()``;
        ``.cancel()`` (from any thread) stops it. The request goes through the engine's ``submit``, so it
        is batched with concurrent queries, batches and server requests on the same engine."""
        spec = self._spec(method, ratio, question, top_k)
        prepared = self._prepare(question, top_k, chunk_ids, spec)
        handle = self.engine.submit(prepared.segments, spec, self._sampling(sampling, max_tokens))
        return MappedStream(handle, prepared.result)

    def query_batch(
        self,
        questions: Sequence[str],
        top_k: int | None = None,
        method: str | None = None,
        ratio: float | None = None,
        chunk_ids: Sequence[str] | None = None,
        sampling: SamplingParams | None = None,
        max_tokens: int | None = None,
    ) -> list[QueryResult]:
        """Retrieve for every question, then answer them all together through the engine's
        ``generate_batch``; results in question order. Questions admitted together whose chunks are the
        same share one blend of them (a round, the ``batch_rounds`` setting); the others' greedy answers
        equal :meth:`query`'s."""
        spec = self._checked(method, ratio, top_k, questions)
        sampling = self._sampling(sampling, max_tokens)
        return self._answer_together(questions, top_k, chunk_ids, spec, sampling, self.engine.generate_batch)

    def query_round(
        self,
        questions: Sequence[str],
        top_k: int | None = None,
        method: str | None = None,
        ratio: float | None = None,
        chunk_ids: Sequence[str] | None = None,
        sampling: SamplingParams | None = None,
        max_tokens: int | None = None,
    ) -> list[QueryResult]:
        """Answer ``questions`` (agents of one round) over the same chunks, blended once for all of them:
        ``chunk_ids``, or the top-k chunks retrieved once for the questions together. Results in
        question order, each reporting the round it shared."""
        if not questions:
            return []
        spec = self._checked(method, ratio, top_k, questions)
        _check_chunk_ids(chunk_ids)
        shared = list(chunk_ids) if chunk_ids is not None else None
        if shared is None:
            shared = [c.chunk_id for c in self.retrieve("\n".join(questions), top_k)]
        sampling = self._sampling(sampling, max_tokens)
        return self._answer_together(questions, top_k, shared, spec, sampling, self.engine.generate_round)

    def _sampling(self, sampling: SamplingParams | None, max_tokens: int | None) -> SamplingParams:
        """``sampling`` with ``max_tokens`` when given; without either, the ``max_tokens`` setting."""
        if sampling is None:
            return SamplingParams(max_new_tokens=self.config.max_tokens if max_tokens is None else max_tokens)
        return sampling if max_tokens is None else replace(sampling, max_new_tokens=max_tokens)

    def _spec(
        self, method: str | None, ratio: float | None, question: str | None, top_k: int | None
    ) -> MethodSpec:
        return check_request(method or self.config.method, ratio=ratio, question=question, top_k=top_k)

    def _checked(self, method, ratio, top_k, questions: Sequence[str]) -> MethodSpec:
        spec = self._spec(method, ratio, None, top_k)
        for question in questions:
            check_request(spec, question=question)
        return spec

    def _answer_together(self, questions, top_k, chunk_ids, spec, sampling, generate) -> list[QueryResult]:
        """Prepare every question's prompt, answer them in one ``generate`` call, results in order."""
        prepared = [self._prepare(question, top_k, chunk_ids, spec) for question in questions]
        generated = generate([BatchRequest(p.segments, spec, sampling) for p in prepared])
        return [p.result(result) for p, result in zip(prepared, generated, strict=True)]

    def check(
        self,
        questions: Sequence[str] | None = None,
        ratios: Sequence[float | None] | None = None,
        method: str | None = None,
        target_agreement: float | None = None,
        max_new_tokens: int = DEFAULT_CHECK_MAX_TOKENS,
        sample: int = 20,
        top_k: int | None = None,
        *,
        max_tokens: int | None = None,
        decisive_margin: float = DECISIVE_MARGIN,
    ) -> CheckReport:
        """Evidence on this model and corpus before turning KV reuse on: answer each question (retrieved
        for as :meth:`query` does) by full prefill and by ``method`` (default: the settings') at each of
        ``ratios`` (default: the ``ratio`` setting), side by side, and report per method the first-token
        agreement (on all questions, on decisive ones, where full prefill's first token leads its
        runner-up by at least ``decisive_margin`` nats, and on the near-ties left), mean first-token KL
        and agreement F1 against full prefill (``eval``'s metrics), median TTFT and the median speed-up,
        and the lowest ratio whose decisive first-token agreement reaches ``target_agreement``. Without
        ``questions``, ``sample`` questions are derived from the corpus's chunks
        (:func:`~cacheblend_rag.check.sample_questions` gives the rule). ``max_tokens`` is
        ``max_new_tokens`` under the name every other entry point uses. Needs the PyTorch engine."""
        from .check import run_check

        budget = max_new_tokens if max_tokens is None else max_tokens
        return run_check(
            self, questions, ratios, method, target_agreement, budget, sample, top_k, decisive_margin
        )

    def _prepare(
        self, question: str, top_k: int | None, chunk_ids: Sequence[str] | None, method: MethodSpec
    ) -> _Prepared:
        _check_chunk_ids(chunk_ids)
        started = time.perf_counter()
        chunks = (
            self.corpus.get_chunks(chunk_ids) if chunk_ids is not None else self.retrieve(question, top_k)
        )
        retrieval_s = time.perf_counter() - started
        refs = [ChunkRef(c.token_ids, c.chunk_id) for c in chunks]
        return _Prepared(chunks, self.engine.rag_segments(question, refs, method), retrieval_s)


def _check_chunk_ids(chunk_ids: Sequence[str] | None) -> None:
    """Refuse an empty ``chunk_ids``: None means "retrieve", and an empty list is more likely a caller's
    empty selection than a wish for an answer from no passage at all."""
    if chunk_ids is not None and len(chunk_ids) == 0:
        raise ValueError(
            "chunk_ids is empty: pass at least one chunk id, or leave chunk_ids out (None) to retrieve"
        )
