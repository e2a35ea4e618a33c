"""The engine contract: what every engine (the PyTorch :class:`~cacheblend_rag.engine.Engine`, the vLLM
:class:`~cacheblend_rag.engine.vllm.VLLMEngine`) offers the layers above it, and the types they share.

Roles of an engine (:class:`EngineProtocol`), as vLLM's ``kv_connector/v1/base.py`` documents a
connector's:

- **identity**: ``model`` (name, fingerprint, tokenizer), ``context_window``, ``store`` (the chunk KV
  store it reads and writes) and ``controller`` (the loading controller that picks a method's ratio when
  the caller gives none);
- **prompt building**: ``prompts`` (the chat template), ``rag_segments`` / ``chat_segments`` /
  ``segments``, which lay a prompt out as :class:`~cacheblend_rag.blend.Segment` objects with the KV the
  method reuses attached;
- **chunk KV**: ``chunk_kv`` (from the store, computed and stored on a miss), ``ensure_chunk_kv``
  (precompute for ingest);
- **generation**: ``submit`` takes one :class:`~.request.GenerationRequest` (built once at the edge) and
  returns a :class:`StreamHandle` (iterate it for :class:`TokenEvent` objects, then ``.result()``;
  ``cancel()`` stops it); it is the one entry every answer goes through: the PyTorch engine serves it
  through its one :class:`~cacheblend_rag.engine.scheduler.BatchScheduler` (``scheduler``), the vLLM
  engine through vLLM's own scheduling of concurrent streams (``scheduler`` is None). ``generate`` /
  ``stream`` (:class:`Submitting`) build the request from the usual arguments and submit it;
  ``generate_batch`` / ``generate_round`` submit several together. Every answer is a
  :class:`GenerationResult` built by :meth:`GenerationResult.build`;
- **lifecycle**: ``close``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from ..blend.controller import LoadingController
from ..blend.methods import Reuse
from ..blend.segments import ChunkContext, ChunkKVSource, Segment
from ..config import DEFAULT_METHOD
from ..errors import RequestCancelledError
from ..store.kvstore import KVStore
from .prompt import ChunkRef, PromptBuilder, PromptPart
from .request import GenerationRequest, Method
from .results import (
    NOT_JSON,
    CacheAccounting,
    FusionDiagnostics,
    FusionStats,
    GenerationResult,
    PromptAccounting,
    ServedAs,
    fusion_figures,
)

__all__ = [
    "NOT_JSON",
    "CacheAccounting",
    "EngineProtocol",
    "FusionDiagnostics",
    "FusionStats",
    "GenerationResult",
    "PromptAccounting",
    "PromptSegments",
    "ServedAs",
    "StreamHandle",
    "Submitting",
    "TokenEvent",
    "TokenStream",
    "eos_token_ids",
    "fusion_figures",
]
from .sampling import SamplingParams

R = TypeVar("R")


@dataclass(frozen=True)
class TokenEvent:
    """One generated token while streaming: its id and the text it adds."""

    token_id: int
    text: str


@runtime_checkable
class StreamHandle(Protocol[R]):
    """A request being answered: iterate it for its tokens (once), then :meth:`result` gives the final
    result (waiting for it, or generating what was not iterated yet). :meth:`cancel` (from any thread)
    stops it: a client that abandons a stream cancels it, so its row stops decoding."""

    submitted_at: float  # perf_counter time the engine took the request

    def __iter__(self) -> Iterator[TokenEvent]: ...

    def result(self) -> R: ...

    def cancel(self) -> bool:
        """Stop the request unless it has finished (False then). Iteration ends and :meth:`result`
        raises :class:`~cacheblend_rag.errors.RequestCancelledError`."""
        ...


class TokenStream(Generic[R]):
    """A :class:`StreamHandle` over a generator that yields :class:`TokenEvent` objects and returns the
    result. Nothing runs until it is iterated (or :meth:`result` is called); cancelling it closes the
    generator (at once, or once the token being generated on another thread is there)."""

    def __init__(self, events: Generator[TokenEvent, None, R]) -> None:
        self.submitted_at = time.perf_counter()
        self._events = events
        self._finished = False
        self._cancelled = False
        self._result: R | None = None
        # held while the generator runs, so that cancel() from another thread never closes it mid-step
        self._running = threading.Lock()

    def __iter__(self) -> Iterator[TokenEvent]:
        return self

    def __next__(self) -> TokenEvent:
        with self._running:
            if self._cancelled:
                self._events.close()
                raise RequestCancelledError("the request was cancelled")
            if self._finished:
                raise StopIteration
            try:
                event = next(self._events)
            except StopIteration as stop:
                self._finished, self._result = True, stop.value
                raise StopIteration from None
            if self._cancelled:  # cancelled while this token was generated
                self._events.close()
                raise RequestCancelledError("the request was cancelled")
            return event

    def result(self) -> R:
        for _ in self:
            pass
        return self._result  # type: ignore[return-value]

    def cancel(self) -> bool:
        if self._finished or self._cancelled:
            return False
        self._cancelled = True
        if self._running.acquire(blocking=False):  # else the iterating thread closes it after its token
            try:
                self._events.close()
            finally:
                self._running.release()
        return True

    def close(self) -> None:
        """Stop generating (what ``yield from`` calls on a stream it wraps when it is closed itself)."""
        self.cancel()


class PromptSegments:
    """Prompt building shared by the engines: RAG and chat prompts as segments, given the engine's
    :meth:`segments` (which attaches the KV a method reuses)."""

    prompts: PromptBuilder

    def segments(self, parts: Sequence[PromptPart], method: Method | Reuse) -> list[Segment]:
        raise NotImplementedError

    def rag_segments(
        self, question: str, chunks: Sequence[ChunkRef], method: Method | Reuse
    ) -> list[Segment]:
        """A RAG prompt (the chat template around the chunks and the question) as segments."""
        if not question.strip():
            raise ValueError("the question is empty")
        return self.segments(self.prompts.rag_parts(question, chunks), method)

    def chat_segments(self, messages: Sequence[dict]) -> list[Segment]:
        """A chat ({role, content} messages) as one fresh segment, generation prompt added."""
        return [Segment.fresh(self.prompts.chat_ids(messages))]


class Submitting:
    """The shortcuts both engines offer over their one entry, :meth:`submit`: a request built from the
    usual arguments (:meth:`GenerationRequest.of`), streamed or waited for."""

    def submit(self, request: GenerationRequest) -> StreamHandle:
        raise NotImplementedError

    def stream(
        self,
        segments: list[Segment],
        method: Method = DEFAULT_METHOD,
        sampling: SamplingParams | None = None,
        **method_options: Any,
    ) -> StreamHandle:
        """Answer ``segments`` with ``method`` (``method_options`` are the method's; a ratio left out is
        chosen by the loading controller) through :meth:`submit`; iterate the handle for tokens, then
        ``.result()``; ``.cancel()`` stops it. Bad input raises here."""
        return self.submit(GenerationRequest.of(segments, method, sampling, method_options))

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """:meth:`stream` (same arguments), waited for: the answer's result."""
        return self.stream(*args, **kwargs).result()


class ModelIdentity(Protocol):
    """What an engine tells about its model without exposing its weights."""

    name: str
    fingerprint: str
    tokenizer: Any


@runtime_checkable
class EngineProtocol(Protocol):
    """The engine contract (see the module docstring for the roles)."""

    model: ModelIdentity
    store: KVStore
    prompts: PromptBuilder
    controller: LoadingController
    eos_ids: set[int]
    # whether concurrent requests are batched by the engine itself (vLLM) rather than by our scheduler
    # (the PyTorch engine's). Either way ``submit`` batches: callers need not ask.
    batches_requests: bool
    # the engine's BatchScheduler (PyTorch: started on first use), None where the engine batches itself;
    # typed Any because the scheduler's module imports this one
    scheduler: Any

    @property
    def context_window(self) -> int: ...

    def rag_segments(
        self, question: str, chunks: Sequence[ChunkRef], method: Method | Reuse
    ) -> list[Segment]:
        """A RAG prompt (the chat template around the chunks and the question) as segments."""
        ...

    def chat_segments(self, messages: Sequence[dict]) -> list[Segment]:
        """A chat ({role, content} messages) as one fresh segment, generation prompt added."""
        ...

    def segments(self, parts: Sequence[PromptPart], method: Method | Reuse) -> list[Segment]:
        """A prompt laid out as fresh token runs and chunks, with the KV ``method`` reuses."""
        ...

    chunk_context: ChunkContext  # what chunks are prefilled behind; part of their KV keys

    def chunk_key(self, token_ids: Sequence[int]) -> str:
        """The KV store key of a chunk's KV (model, storage dtype, chunk context, token ids)."""
        ...

    def chunk_kv(self, token_ids: Sequence[int]) -> ChunkKVSource:
        """A chunk's KV from the store, computed and stored on a miss."""
        ...

    def ensure_chunk_kv(self, token_ids: Sequence[int]) -> int:
        """Compute and store a chunk's KV unless present; the bytes written."""
        ...

    def submit(self, request: GenerationRequest) -> StreamHandle[GenerationResult]:
        """Serve ``request``, batched with concurrent ones the way the engine batches them: the one
        entry every answer goes through (``generate`` and ``stream`` call it)."""
        ...

    def generate(self, *args: Any, **kwargs: Any) -> GenerationResult:
        """:meth:`submit` of the request :class:`Submitting`'s ``stream`` builds, waited for."""
        ...

    def stream(self, *args: Any, **kwargs: Any) -> StreamHandle[GenerationResult]:
        """:meth:`submit` of a request built from ``segments, method, sampling, **method_options``."""
        ...

    def generate_batch(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Serve ``requests`` together; results in order."""
        ...

    def generate_round(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Serve ``requests`` (agents reading the same chunks) together as one round where the engine
        can share a blend of their chunks; results in order, each reporting its round."""
        ...

    def close(self) -> None: ...


def eos_token_ids(tokenizer: Any, configured: int | Collection[int] | None) -> set[int]:
    """End-of-sequence ids: the tokenizer's and those of the model's generation config."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else configured)
    return ids
