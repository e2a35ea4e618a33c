"""Question answering over an ingested corpus: retrieve the top chunks, fuse their KV, generate."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, Unpack

from .blend.budget_choice import BudgetChoice
from .blend.spec import MethodSpec
from .config import Config
from .corpus.corpus import Corpus, RetrievedChunk
from .engine import (
    ChunkRef,
    EdgeTimings,
    EngineProtocol,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StreamHandle,
)
from .engine.base import PromptAccounting, ServedAs
from .engine.bounds import check_request
from .engine.handles import MappedStream
from .engine.session import Session
from .settings import get_settings

if TYPE_CHECKING:
    from .check import CheckOptions, CheckReport

log = logging.getLogger(__name__)


class QueryOptions(TypedDict, total=False):
    """What a question is answered with (every answering method takes them by name): ``top_k`` chunks
    retrieved (default: the ``top_k`` setting), or explicit ``chunk_ids`` (an empty list is refused: it
    would answer from no passage at all); ``method`` (a name or spec, default: the ``method`` setting) and
    its ``ratio`` (left out: the loading controller chooses it); ``sampling`` and ``max_tokens``, the most
    tokens of the answer (default: the ``max_tokens`` setting; it overrides ``sampling``'s)."""

    top_k: int | None
    method: str | None
    ratio: float | None
    chunk_ids: Sequence[str] | None
    sampling: SamplingParams | None
    max_tokens: int | None


@dataclass
class QueryResult(PromptAccounting, ServedAs):
    """An answer with its retrieval and fusion accounting (what ``query --json`` prints). ``ttft_s`` and
    ``total_s`` count from the call (retrieval and chunk KV computed for it included; the parts are the
    :class:`~cacheblend_rag.engine.base.ServedAs` fields)."""

    answer: str
    method: str
    ttft_s: float
    total_s: float
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
    request: GenerationRequest

    def result(self, generated: GenerationResult) -> QueryResult:
        chunks = self.chunks
        return QueryResult(
            answer=generated.text.strip(),
            method=generated.method,
            ttft_s=generated.ttft_s,
            total_s=generated.total_s,
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
            **generated.served(),
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

    def query(self, question: str, **options: Unpack[QueryOptions]) -> QueryResult:
        """Answer ``question`` from the top-k retrieved chunks or the given ``chunk_ids``
        (:class:`QueryOptions`)."""
        return self.stream(question, **options).result()

    def stream(self, question: str, **options: Unpack[QueryOptions]) -> StreamHandle[QueryResult]:
        """Like :meth:`query`; iterate the handle for tokens as they come, then ``.result()``;
        ``.cancel()`` (from any thread) stops it. The request goes through the engine's ``submit``, so it
        is batched with concurrent queries, batches and server requests on the same engine."""
        arrived = time.perf_counter()
        spec = self._spec(options, question)
        prepared = self._prepare(question, options, spec, arrived)
        return MappedStream(self.engine.submit(prepared.request), prepared.result)

    def query_batch(self, questions: Sequence[str], **options: Unpack[QueryOptions]) -> list[QueryResult]:
        """Retrieve for every question, then answer them all together through the engine's
        ``generate_batch``; results in question order. Questions admitted together whose chunks are the
        same share one blend of them (a round, the ``batch_rounds`` setting); the others' greedy answers
        equal :meth:`query`'s."""
        arrived = time.perf_counter()
        spec = self._checked(options, questions)
        return self._answer_together(questions, options, spec, arrived, self.engine.generate_batch)

    def query_round(self, questions: Sequence[str], **options: Unpack[QueryOptions]) -> list[QueryResult]:
        """Answer ``questions`` (agents of one round) over the same chunks, blended once for all of them:
        ``chunk_ids``, or the top-k chunks retrieved once for the questions together. Results in
        question order, each reporting the round it shared."""
        if not questions:
            return []
        arrived = time.perf_counter()
        spec = self._checked(options, questions)
        chunk_ids = options.get("chunk_ids")
        _check_chunk_ids(chunk_ids)
        if chunk_ids is None:
            retrieved = self.retrieve("\n".join(questions), options.get("top_k"))
            options = {**options, "chunk_ids": [c.chunk_id for c in retrieved]}
        return self._answer_together(questions, options, spec, arrived, self.engine.generate_round)

    def _sampling(self, options: QueryOptions) -> SamplingParams:
        """``sampling`` with ``max_tokens`` when given; without either, the ``max_tokens`` setting."""
        sampling, max_tokens = options.get("sampling"), options.get("max_tokens")
        if sampling is None:
            return SamplingParams(max_tokens=self.config.max_tokens if max_tokens is None else max_tokens)
        return sampling if max_tokens is None else replace(sampling, max_tokens=max_tokens)

    def _spec(self, options: QueryOptions, question: str | None) -> MethodSpec:
        method = options.get("method") or self.config.method
        return check_request(
            method, ratio=options.get("ratio"), question=question, top_k=options.get("top_k")
        )

    def _checked(self, options: QueryOptions, questions: Sequence[str]) -> MethodSpec:
        spec = self._spec(options, None)
        for question in questions:
            check_request(spec, question=question)
        return spec

    def _answer_together(self, questions, options, spec, arrived, generate) -> list[QueryResult]:
        """Prepare every question's prompt, answer them in one ``generate`` call, results in order."""
        prepared = [self._prepare(question, options, spec, arrived) for question in questions]
        generated = generate([p.request for p in prepared])
        return [p.result(result) for p, result in zip(prepared, generated, strict=True)]

    def check(self, questions: Sequence[str] | None = None, **options: Unpack[CheckOptions]) -> CheckReport:
        """Evidence on this model and corpus before turning KV reuse on: answer each question (retrieved
        for as :meth:`query` does) by full prefill and by ``method`` (default: the settings') at each of
        ``ratios`` (default: the ``ratio`` setting), side by side, and report per method the first-token
        agreement (on all questions, on decisive ones, where full prefill's first token leads its
        runner-up by at least ``decisive_margin`` nats, and on the near-ties left), the answers' agreement
        with full prefill's (the share identical and their F1), mean first-token KL, median TTFT and the
        median speed-up, and the lowest ratio whose decisive first-token agreement and answer F1 both
        reach ``target_agreement``. Without ``questions``, ``sample`` questions are derived from the
        corpus's chunks (:func:`~cacheblend_rag.check.sample_questions` gives the rule); answers are at
        most ``max_tokens`` tokens (:class:`~cacheblend_rag.check.CheckOptions`). Needs the PyTorch
        engine."""
        from .check import run_check

        return run_check(self, questions, **options)

    def _prepare(self, question: str, options: QueryOptions, spec: MethodSpec, arrived: float) -> _Prepared:
        """The request for ``question``: its chunks retrieved (or read by id) and its prompt laid out
        (their KV read, or computed where no tier holds it), each part timed; it arrived at ``arrived``."""
        chunk_ids = options.get("chunk_ids")
        _check_chunk_ids(chunk_ids)
        started = time.perf_counter()
        if chunk_ids is not None:
            chunks = self.corpus.get_chunks(chunk_ids)
        else:
            chunks = self.retrieve(question, options.get("top_k"))
        retrieved = time.perf_counter()
        refs = [ChunkRef(c.token_ids, c.chunk_id) for c in chunks]
        segments = self.engine.rag_segments(question, refs, spec)
        edge = EdgeTimings(retrieval_s=retrieved - started, prompt_s=time.perf_counter() - retrieved)
        request = GenerationRequest(segments, spec, self._sampling(options), arrived, edge)
        return _Prepared(chunks, request)


def _check_chunk_ids(chunk_ids: Sequence[str] | None) -> None:
    """Refuse an empty ``chunk_ids``: None means "retrieve", and an empty list is more likely a caller's
    empty selection than a wish for an answer from no passage at all."""
    if chunk_ids is not None and len(chunk_ids) == 0:
        raise ValueError(
            "chunk_ids is empty: pass at least one chunk id, or leave chunk_ids out (None) to retrieve"
        )
