"""Serve prompts that a framework (LangChain, LlamaIndex) has already written out as text.

A framework hands the model a finished prompt: retrieved passages pasted into a template. To reuse chunk
KV, :class:`PromptFrontend` cuts that text back into segments:

- **explicit documents** (the framework passes the documents it pasted, e.g. our RAG chains do): each
  document's text is located in the prompt; a stored chunk keeps its id, any other text is chunked,
  added to the corpus (so the next prompt recognises it) and its KV computed once;
- **recognition** (a stock chain that passes only text): :class:`ChunkTextIndex` finds every span of the
  prompt that is exactly the text of a stored chunk.

Matched spans become cached segments with the chunk's *stored* token ids and KV; the text around them
(chat template, instructions, the question) is tokenized as fresh segments. Every method (full recompute
included) sees the same token ids for one prompt, so their answers are comparable token for token.

The frontend uses only the engine contract (:class:`~cacheblend_rag.engine.EngineProtocol`), so either
engine serves it; over a corpus, it holds the corpus and engine as a checked
:class:`~cacheblend_rag.engine.session.Session`. The process shares one frontend per (corpus, model,
engine kind, settings) (:mod:`.frontends`) and one corpus per directory (:mod:`.corpora`).

Batching is the engine's: requests go to its ``submit`` / ``generate_batch``, which the PyTorch engine
serves through its one :class:`~cacheblend_rag.engine.scheduler.BatchScheduler` (continuous batching
across callers, shared chunk reads) and vLLM batches by itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..blend.segments import Segment
from ..blend.spec import MethodSpec
from ..config import DEFAULT_MAX_TOKENS, DEFAULT_METHOD, DEFAULTS, Config
from ..corpus.corpus import Corpus, RetrievedChunk
from ..engine import (
    BatchScheduler,
    ChunkRef,
    EdgeTimings,
    EngineClosedError,
    EngineProtocol,
    GenerationRequest,
    GenerationResult,
    JsonConstraint,
    PromptPart,
    SamplingParams,
    StreamHandle,
    create_engine,
)
from ..engine.bounds import check_request
from ..engine.prompt import part_ids
from ..engine.session import Session
from ..errors import ChunkNotFoundError, InvalidChunkIdError
from ..rag import CacheBlendRAG
from ..text.chunker import Chunker, validate_chunk_id
from .corpora import acquire_corpus, release_corpus
from .recognition import ANCHOR_CHARS, ChunkSpan, ChunkTextIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DocumentRef:
    """A document the caller knows is pasted into the prompt: its exact text and, if known, chunk id."""

    text: str
    chunk_id: str | None = None


@dataclass(frozen=True)
class TextRequest:
    """One prompt to answer: its full text (chat template already applied), or its ``parts`` if laid out
    already (then ``text`` is unused: :meth:`PromptFrontend.part_segments`), and how to generate."""

    text: str
    documents: tuple[DocumentRef, ...] = ()
    method: MethodSpec = field(default_factory=lambda: MethodSpec.parse(DEFAULT_METHOD))
    sampling: SamplingParams = field(default_factory=SamplingParams)
    parts: tuple[PromptPart, ...] = ()
    # when the caller's call began (``time.perf_counter()``): the answer's ``ttft_s`` counts from here
    arrived_at: float = field(default_factory=time.perf_counter)


def text_request(
    text: str,
    documents: Sequence[DocumentRef] = (),
    *,
    method: str | None = None,
    ratio: float | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] | None = None,
    constraint: JsonConstraint | None = None,
    strict: bool = False,
    parts: Sequence[PromptPart] = (),
    arrived_at: float | None = None,
) -> TextRequest:
    """A :class:`TextRequest` from the usual generation options. ``method`` (a name or spec such as
    ``cacheblend@0.3``) defaults to the settings'; ``ratio`` sets the recompute ratio of a method that has
    one, and without it the loading controller chooses; ``constraint`` makes the answer JSON (structured
    output, :func:`~.structured.constraint_of`); ``parts``: the prompt laid out already, used instead of
    ``text``; ``arrived_at``: when the caller's call began (default: now). A bad method or option is refused
    here."""
    spec = check_request(method or DEFAULT_METHOD, ratio=ratio)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=tuple(stop or ()),
        constraint=constraint,
        strict=strict,
    )
    arrived = time.perf_counter() if arrived_at is None else arrived_at
    return TextRequest(text, tuple(documents), spec, sampling, tuple(parts), arrived)


class PromptFrontend:
    """Turns finished prompt texts into segments and answers them with one engine (see the module doc).

    ``corpus_dir``: an ingested corpus (chunks are recognised in it and documents added to it); without one,
    nothing is recognised and explicit documents are only KV-cached (in the engine's default KV store).
    ``model``: default the corpus's model (or ``config.model`` without a corpus); ``engine``: an
    already loaded engine over the corpus's model instead; ``engine_kind``: the kind of engine to load
    ("torch" or "vllm", default: ``config.engine``). ``config``: the caller's settings (the engine's,
    the corpus's KV store options, the chunk size without a corpus, the batch scheduler's limits).

    Over a corpus, :attr:`session` is the corpus and its engine, checked once to belong together
    (:meth:`Session.open`), and :attr:`rag` answers questions over them; None without a corpus.
    """

    def __init__(
        self,
        corpus_dir: str | Path | None = None,
        model: str | Path | None = None,
        engine: EngineProtocol | None = None,
        engine_kind: str | None = None,
        config: Config = DEFAULTS,
    ) -> None:
        self.config = config
        self._owned_engine: EngineProtocol | None = None
        self._rag: CacheBlendRAG | None = None  # built when first asked for (rag)
        if corpus_dir is not None:
            corpus = acquire_corpus(corpus_dir, config=config)  # released by close()
            try:
                # the corpus and the engine, checked once to belong together
                self.session: Session | None = Session.open(corpus, engine_kind, model, config, engine=engine)
            except BaseException:
                release_corpus(corpus)
                raise
            self.engine: EngineProtocol = self.session.engine
            self.corpus: Corpus | None = self.session.corpus
            self.index: ChunkTextIndex | None = ChunkTextIndex(self.session.corpus)
        else:
            self.session, self.corpus, self.index = None, None, None
            self.engine = engine or create_engine(
                engine_kind or config.engine, model or config.model, config=config
            )
            self._owned_engine = None if engine is not None else self.engine
        self._chunker: Chunker | None = None
        self._close_lock = threading.Lock()
        self.closed = False

    def close(self) -> None:
        """Close the engine this frontend built (its scheduler finishing the requests already submitted,
        its KV store, and its hold on the shared model)."""
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
        if self.session is not None:
            self.session.close()  # the engine it built (a given one stays its owner's)
            release_corpus(self.session.corpus)  # the last holder closes it
        elif self._owned_engine is not None:
            self._owned_engine.close()

    @property
    def rag(self) -> CacheBlendRAG | None:
        """Question answering over the frontend's session (built on first use; its corpus and engine stay
        the frontend's); None without a corpus."""
        if self.session is None:
            return None
        with self._close_lock:
            if self._rag is None:
                self._rag = CacheBlendRAG(self.session, config=self.config)
            return self._rag

    @property
    def model_name(self) -> str:
        return self.engine.model.name

    @property
    def context_window(self) -> int:
        return self.engine.context_window

    def render_chat(self, messages: Sequence[dict]) -> str:
        """The model's chat template applied to ``messages`` ({role, content}), generation prompt added."""
        return self.engine.prompts.render_chat(messages)

    def chunk_documents(self, chunk_ids: Sequence[str]) -> list[DocumentRef]:
        """Stored chunks, by id, as documents to pass with a prompt."""
        return [DocumentRef(c.text, c.chunk_id) for c in self._stored(chunk_ids)]

    def chunk_refs(self, chunk_ids: Sequence[str]) -> list[ChunkRef]:
        """Stored chunks, by id, as prompt parts (:meth:`PromptBuilder.chat_parts`): stored token ids."""
        return [ChunkRef(c.token_ids, c.chunk_id) for c in self._stored(chunk_ids)]

    def _stored(self, chunk_ids: Sequence[str]) -> list[RetrievedChunk]:
        if self.corpus is None:
            raise ValueError("chunk ids were passed, but there is no corpus to look them up in")
        return self.corpus.get_chunks(chunk_ids)

    # -- segments ------------------------------------------------------------------------------------

    def spans(
        self, text: str, documents: Sequence[DocumentRef] = (), recognise: bool = True, remember: bool = True
    ) -> list[ChunkSpan]:
        """Where chunks sit in ``text``: the given documents first, then (with ``recognise``) stored chunks
        found in the text between them. ``remember``: add documents the corpus lacks to it."""
        spans: list[ChunkSpan] = []
        cursor = 0
        for doc in documents:
            if not doc.text.strip():
                continue
            at = self._locate(text, doc.text, cursor, spans)
            if at is None:
                log.warning(
                    "a document passed with the prompt does not appear in it verbatim; it is computed as "
                    "plain prompt text (first characters: %r)",
                    doc.text[:40],
                )
                continue
            for chunk_id, chunk_text, token_ids in self._document_chunks(doc, remember):
                spans.append(ChunkSpan(at, at + len(chunk_text), chunk_id, token_ids))
                at += len(chunk_text)
            cursor = at
        spans.sort(key=lambda s: s.start)
        if recognise and self.index is not None:
            gaps, previous = [], 0
            for span in spans:
                gaps.append((previous, span.start))
                previous = span.end
            gaps.append((previous, len(text)))
            spans.extend(
                found for a, b in gaps if b - a >= ANCHOR_CHARS for found in self.index.find(text, a, b)
            )
            spans.sort(key=lambda s: s.start)
        return spans

    def segments(
        self,
        text: str,
        documents: Sequence[DocumentRef] = (),
        method: str | MethodSpec = DEFAULT_METHOD,
        recognise: bool = True,
        remember: bool = True,
    ) -> list[Segment]:
        """Fresh segments for the text between chunk spans and chunk segments (stored token ids) for the
        spans, with the KV ``method`` reuses attached."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("the prompt is empty")
        return self._segments(text, self.spans(text, documents, recognise, remember), method)

    def part_segments(self, parts: Sequence[PromptPart], method: str | MethodSpec) -> list[Segment]:
        """A prompt laid out already (chunks placed by id, no text searched) with the KV ``method`` reuses."""
        if not any(part_ids(p) for p in parts):
            raise ValueError("the prompt is empty")
        return self.engine.segments(parts, method)

    def _segments(self, text: str, spans: Sequence[ChunkSpan], method: str | MethodSpec) -> list[Segment]:
        parts: list[PromptPart] = []
        previous = 0
        for span in spans:
            parts.append(tuple(self.engine.prompts.encode(text[previous : span.start])))
            parts.append(ChunkRef(span.token_ids, span.chunk_id))
            previous = span.end
        parts.append(tuple(self.engine.prompts.encode(text[previous:])))
        return self.engine.segments(parts, method)

    def _locate(self, text: str, needle: str, cursor: int, taken: list[ChunkSpan]) -> int | None:
        if not needle:
            return None
        for start in (cursor, 0):
            at = text.find(needle, start)
            while at >= 0:
                if not any(at < s.end and s.start < at + len(needle) for s in taken):
                    return at
                at = text.find(needle, at + 1)
        return None

    def _document_chunks(self, doc: DocumentRef, remember: bool) -> list[tuple[str, str, tuple[int, ...]]]:
        """(chunk id, text, token ids) of the chunks that make up ``doc.text``, in order."""
        corpus = self.corpus
        if corpus is not None:
            if doc.chunk_id is not None:
                try:
                    (stored,) = corpus.get_chunks([validate_chunk_id(doc.chunk_id)])
                    if stored.text == doc.text:
                        return [(stored.chunk_id, stored.text, stored.token_ids)]
                except (InvalidChunkIdError, ChunkNotFoundError):
                    pass  # an id from another system: fall back to the text
            found = corpus.find_by_text(doc.text)
            if found is not None:
                return [(found.chunk_id, found.text, found.token_ids)]
            split = self.chunker.split(doc.text)
            if len(corpus.db.known_chunk_ids([c.chunk_id for c in split])) == len(
                {c.chunk_id for c in split}
            ):
                # a stored document longer than one chunk: its chunks, by their content ids
                return [(c.chunk_id, c.text, c.token_ids) for c in split]
            if remember and not corpus.db.readonly and corpus.can_embed:
                (ids,) = corpus.add_texts([doc.text])
                return [(c.chunk_id, c.text, c.token_ids) for c in corpus.get_chunks(ids)]
            return [(c.chunk_id, c.text, c.token_ids) for c in split]
        return [(c.chunk_id, c.text, c.token_ids) for c in self.chunker.split(doc.text)]

    @property
    def chunker(self) -> Chunker:
        if self.corpus is not None:
            return self.corpus.chunker
        if self._chunker is None:
            self._chunker = Chunker(self.engine.model.tokenizer, self.config.chunk_tokens)
        return self._chunker

    # -- generation ----------------------------------------------------------------------------------

    @property
    def scheduler(self) -> BatchScheduler | None:
        """The engine's batch scheduler (:attr:`Engine.scheduler`, the PyTorch engine's, started on first
        use); None for an engine that batches its own requests (vLLM)."""
        self._check_open()
        return self.engine.scheduler

    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("this frontend is closed (its model was given back)")

    def stream(
        self,
        request: TextRequest,
        recognise: bool = True,
        remember: bool = True,
        unrecognised: Callable[[], None] | None = None,
    ) -> StreamHandle[GenerationResult]:
        """The answer's handle: iterate it for tokens, then ``.result()`` for its
        :class:`GenerationResult`. ``unrecognised()`` is called when the prompt holds no chunk to reuse
        (none recognised, no documents passed).

        Concurrent calls (a chat model's ``batch``, concurrent async calls) are batched as the engine's
        ``submit`` batches them (the PyTorch engine's :class:`BatchScheduler`, which also shares their
        chunks' reads, or vLLM itself)."""
        self._check_open()
        return self.engine.submit(self._generation_request(request, recognise, remember, unrecognised))

    def generate(
        self, request: TextRequest, recognise: bool = True, remember: bool = True
    ) -> GenerationResult:
        return self.stream(request, recognise, remember).result()

    def generate_batch(
        self,
        requests: Sequence[TextRequest],
        recognise: bool = True,
        remember: bool = True,
        unrecognised: Callable[[], None] | None = None,
    ) -> list[GenerationResult]:
        """Answer every request in one submission (the engine's ``generate_batch``); results in order."""
        self._check_open()
        batch = [self._generation_request(r, recognise, remember, unrecognised) for r in requests]
        return self.engine.generate_batch(batch)

    def _generation_request(
        self,
        request: TextRequest,
        recognise: bool,
        remember: bool,
        unrecognised: Callable[[], None] | None,
    ) -> GenerationRequest:
        """The engine's request for ``request``: its prompt laid out (chunks recognised, their KV read or
        computed), that time kept as a part of its ``ttft_s``, which counts from its arrival."""
        started = time.perf_counter()
        segments = self._request_segments(request, recognise, remember, unrecognised)
        edge = EdgeTimings(prompt_s=time.perf_counter() - started)
        return GenerationRequest(segments, request.method, request.sampling, request.arrived_at, edge)

    def _request_segments(
        self,
        request: TextRequest,
        recognise: bool,
        remember: bool,
        unrecognised: Callable[[], None] | None,
    ) -> list[Segment]:
        if request.parts:  # chunks known by id, placed already: nothing to find
            return self.part_segments(request.parts, request.method)
        text = request.text
        if not isinstance(text, str) or not text.strip():
            raise ValueError("the prompt is empty")
        spans = self.spans(text, request.documents, recognise, remember)
        if not spans and not request.documents and unrecognised is not None:
            unrecognised()
        return self._segments(text, spans, request.method)
