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
- **generation**: ``generate`` (one answer), ``stream`` (a :class:`StreamHandle`: iterate it for
  :class:`TokenEvent` objects, then ``.result()``), ``generate_batch`` (several requests served together);
  every answer is a :class:`GenerationResult` built by :meth:`GenerationResult.build`. Concurrent callers:
  ``submit`` (a :class:`StreamHandle` too) serves a request batched with the others, the engine deciding
  how: the PyTorch engine through its one :class:`~cacheblend_rag.engine.scheduler.BatchScheduler`
  (``scheduler``), the vLLM engine by vLLM's own scheduling of concurrent streams (``scheduler`` is
  None). Every caller serving requests goes through ``submit`` / ``generate_batch``. A stream handle's
  ``cancel()`` stops its request;
- **lifecycle**: ``close``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Generator, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Generic, Protocol, Self, TypeVar, runtime_checkable

import torch

from ..blend.budget_choice import BudgetChoice
from ..blend.controller import LoadingController
from ..blend.fusor import FusionResult
from ..blend.methods import RecomputeMethod, Reuse
from ..blend.segments import ChunkContext, ChunkKVSource, Segment
from ..blend.spec import MethodSpec, ResolvedMethod
from ..config import DEFAULT_METHOD
from ..errors import ContextLengthError, FusionInputError, MaxTokensError, RequestCancelledError
from ..records import plain
from ..store.kvstore import KVStore
from .prompt import ChunkRef, PromptBuilder, PromptPart
from .sampling import SamplingParams

Method = str | MethodSpec | RecomputeMethod
R = TypeVar("R")


@dataclass(frozen=True)
class TokenEvent:
    """One generated token while streaming: its id and the text it adds."""

    token_id: int
    text: str


@dataclass(frozen=True)
class FusionStats:
    """What fusing a prompt cost, as results report it. ``kept_per_segment``: per segment, the tokens
    whose cached KV was kept (empty when the fusion is not known per segment). ``blended``: whether the
    request's method fused it (False where it was prefilled instead, as vLLM does with a request its
    worker could not blend: then no budget of the method chose what was computed)."""

    reused_tokens: int
    computed_tokens: int
    recompute_ratio: float
    load_wait_s: float = 0.0
    kept_per_segment: tuple[int, ...] = ()
    round_requests: int = 0
    round_shared_tokens: int = 0
    round_recomputed_tokens: int = 0
    blended: bool = True

    @classmethod
    def of(cls, fusion: FusionResult) -> FusionStats:
        share = fusion.round
        # a round member's chunks come blended from the round, whose recomputed tokens are recomputed for
        # this request too (once for all members): counted as computed, never as kept or read from cache,
        # so a request reports the same counts in a round as alone
        shared = share.round_recomputed_tokens if share else 0
        return cls(
            fusion.reused_tokens - shared,
            fusion.computed_tokens + shared,
            fusion.recompute_ratio,
            fusion.load_wait_s,
            fusion.kept_per_segment,
            share.requests if share else 0,
            share.shared_tokens if share else 0,
            share.round_recomputed_tokens if share else 0,
        )


@dataclass(frozen=True)
class CacheAccounting:
    """Where a prompt's KV came from (docs/accounting.md): read from a cache tier (exact-prefix hits and
    blended chunks, apart), and chunk KV no tier held, computed for this request. Recomputed tokens are
    the result's ``computed_tokens``."""

    read_exact_tokens: int = 0
    read_blended_tokens: int = 0
    kv_computed_tokens: int = 0

    @classmethod
    def of(cls, segments: Sequence[Segment], fusion: FusionStats) -> CacheAccounting:
        """From the segments (which say whose KV was computed for this request) and what the fusion kept
        of each; without per-segment counts, the reused tokens count as exact reads (a prefix cache's)."""
        computed = sum(len(s) for s in segments if s.is_cached and s.computed)
        if len(fusion.kept_per_segment) != len(segments):
            return cls(read_exact_tokens=fusion.reused_tokens, kv_computed_tokens=computed)
        exact = blended = 0
        for segment, kept in zip(segments, fusion.kept_per_segment, strict=True):
            if not segment.is_cached or segment.computed:
                continue
            if segment.exact:
                exact += kept
            else:
                blended += kept
        # a round recomputed some of the chunks' tokens for every member: not read and kept (FusionStats.of)
        return cls(exact, max(0, blended - fusion.round_recomputed_tokens), computed)


# the metadata of a result field that :meth:`PromptAccounting.to_dict` leaves out (not plain data)
NOT_JSON = {"not_json": True}


@dataclass(kw_only=True)
class PromptAccounting:
    """Where a prompt's KV came from (docs/accounting.md) and what a round shared (docs/rounds.md); the
    same fields on every result that reports an answer."""

    cache_read_exact_tokens: int = 0  # exact-prefix KV read from a cache (kept whole)
    cache_read_blended_tokens: int = 0  # chunk KV read from a cache tier and kept by the blend
    kv_computed_tokens: int = 0  # chunk KV no tier held, computed for this request (then stored)
    # A round (several requests reading the same chunks blended once for all of them): how many requests
    # shared it, this prompt's tokens whose KV came from its blend (counted in reused_tokens too), and
    # the cached tokens the round recomputed once for all of them (in no request's computed_tokens).
    round_requests: int = 0
    round_shared_tokens: int = 0
    round_recomputed_tokens: int = 0

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV was read from a cache and kept (what OpenAI's ``cached_tokens`` and
        LangChain's ``cache_read`` report): never KV computed for this request."""
        return self.cache_read_exact_tokens + self.cache_read_blended_tokens

    def accounting(self) -> dict[str, int]:
        """These fields by name (to carry them to another result type)."""
        return {f.name: getattr(self, f.name) for f in fields(PromptAccounting)}

    def to_dict(self) -> dict[str, Any]:
        """The result's fields as plain JSON values (records as their objects) and ``cached_tokens``;
        a field whose metadata says ``NOT_JSON`` is left out."""
        out = {f.name: plain(getattr(self, f.name)) for f in fields(self) if not f.metadata.get("not_json")}
        return {**out, "cached_tokens": self.cached_tokens}


@dataclass(frozen=True)
class FusionDiagnostics:
    """What scoring an answer's fidelity reads of its prompt's fusion (eval, ``check``), filled when the
    request's :class:`SamplingParams` asked for ``diagnostics``. Every engine fills the first token's
    distribution; a field an engine cannot know is None (the vLLM engine scores no continuation)."""

    first_token_logprobs: torch.Tensor  # float32 [vocab]: log-softmax of the first token's logits
    recomputed_positions: tuple[int, ...] | None  # prompt positions recomputed at the last layer, ascending
    compute_fraction: float | None  # the fusion's matmul token-layers over a full prefill's
    fusion_s: float | None  # seconds the fusion took (loading, recompute and the probe)
    # per SamplingParams.score_continuations: mean NLL per token of the sequence after the prompt
    continuation_nll: tuple[float | None, ...] = ()
    answer_nll: float | None = None  # mean NLL per token of the answer itself, from the logits that chose it


def fusion_figures(fusion: FusionResult) -> dict[str, Any]:
    """The :class:`FusionDiagnostics` fields a fusion gives (the engines' one source for them): the
    positions recomputed at the last layer (ascending), its compute fraction and its seconds."""
    return {
        "recomputed_positions": tuple(sorted(int(p) for p in fusion.selected.tolist())),
        "compute_fraction": float(fusion.compute_fraction),
        "fusion_s": float(fusion.seconds),
    }


@dataclass
class GenerationResult(PromptAccounting):
    """One answer and what producing it cost."""

    text: str
    token_ids: list[int]
    method: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    ttft_s: float
    total_s: float
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    recompute_ratio: float
    chunk_ids: list[str] = field(default_factory=list)
    method_options: dict = field(default_factory=dict)
    load_wait_s: float = 0.0
    controller: dict | None = None  # the loading controller's decision, when it chose the ratio
    # what the method chose for this request from its chunks (an adaptive budget's choice), else None
    budget: BudgetChoice | None = None
    # when the sampling params asked for them; not in to_dict (it holds a tensor)
    diagnostics: FusionDiagnostics | None = field(default=None, metadata=NOT_JSON)

    @classmethod
    def build(
        cls,
        *,
        text: str,
        token_ids: Sequence[int],
        finish_reason: str,
        resolved: ResolvedMethod,
        segments: Sequence[Segment],
        fusion: FusionStats,
        ttft_s: float,
        total_s: float,
        **extra: Any,
    ) -> Self:
        """The result of answering ``segments`` with ``resolved``; ``extra`` fills a subclass's fields."""
        accounting = CacheAccounting.of(segments, fusion)
        return cls(
            text=text,
            token_ids=list(token_ids),
            method=resolved.method.name,
            finish_reason=finish_reason,
            ttft_s=ttft_s,
            total_s=total_s,
            prompt_tokens=sum(len(s) for s in segments),
            reused_tokens=fusion.reused_tokens,
            computed_tokens=fusion.computed_tokens,
            recompute_ratio=fusion.recompute_ratio,
            chunk_ids=[s.chunk_id for s in segments if s.chunk_id],
            method_options=resolved.method.describe(),
            load_wait_s=fusion.load_wait_s,
            controller=resolved.controller,
            budget=(
                resolved.method.request_choice([len(s) for s in segments if s.is_cached and not s.exact])
                if fusion.blended
                else None
            ),
            cache_read_exact_tokens=accounting.read_exact_tokens,
            cache_read_blended_tokens=accounting.read_blended_tokens,
            kv_computed_tokens=accounting.kv_computed_tokens,
            round_requests=fusion.round_requests,
            round_shared_tokens=fusion.round_shared_tokens,
            round_recomputed_tokens=fusion.round_recomputed_tokens,
            **extra,
        )


@dataclass
class BatchRequest:
    """One request of ``generate_batch``: what ``generate`` takes."""

    segments: list[Segment]
    method: Method = DEFAULT_METHOD
    sampling: SamplingParams | None = None
    method_options: dict[str, Any] = field(default_factory=dict)


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
    # whether concurrent ``stream`` calls are batched by the engine itself (vLLM); the PyTorch engine's
    # ``stream`` decodes one request alone. Either way ``submit`` batches: callers need not ask.
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

    def generate(
        self,
        segments: list[Segment],
        method: Method = ...,
        sampling: SamplingParams | None = ...,
        **options: Any,
    ) -> GenerationResult:
        """Answer ``segments`` with ``method`` (``options`` are the method's; a ratio left out is chosen by
        the controller)."""
        ...

    def stream(
        self,
        segments: list[Segment],
        method: Method = ...,
        sampling: SamplingParams | None = ...,
        **options: Any,
    ) -> StreamHandle[GenerationResult]:
        """Like :meth:`generate`, handing tokens out as they are generated."""
        ...

    def submit(
        self,
        segments: list[Segment],
        method: Method = ...,
        sampling: SamplingParams | None = ...,
        **options: Any,
    ) -> StreamHandle[GenerationResult]:
        """Like :meth:`stream`, batched with concurrent requests the way the engine batches them."""
        ...

    def generate_batch(self, requests: Sequence[BatchRequest]) -> list[GenerationResult]:
        """Serve ``requests`` together; results in order."""
        ...

    def generate_round(self, requests: Sequence[BatchRequest]) -> list[GenerationResult]:
        """Serve ``requests`` (agents reading the same chunks) together as one round where the engine
        can share a blend of their chunks; results in order, each reporting its round."""
        ...

    def close(self) -> None: ...


def generation_budget(prompt_tokens: int, sampling: SamplingParams, context: int, where: str) -> int:
    """How many tokens a prompt of ``prompt_tokens`` may generate within ``context`` tokens (``where``
    names that limit in the error raised when the prompt leaves no room): ``sampling.max_new_tokens``, cut
    to what fits, or with ``sampling.strict_max_tokens`` refused (:class:`MaxTokensError`) if more."""
    max_new_tokens = sampling.max_new_tokens
    if prompt_tokens == 0:
        raise FusionInputError("nothing to generate from: the prompt has no tokens")
    room = context - prompt_tokens
    if room < 1:
        raise ContextLengthError(
            f"prompt of {prompt_tokens} tokens leaves no room to generate within {where} of {context} tokens"
        )
    if sampling.strict_max_tokens and max_new_tokens > room:
        raise MaxTokensError(
            f"max_tokens {max_new_tokens} does not fit: the prompt's {prompt_tokens} tokens leave {room} of "
            f"{where} of {context} tokens; ask for at most {room}"
        )
    return min(max_new_tokens, room)


def eos_token_ids(tokenizer: Any, configured: int | Collection[int] | None) -> set[int]:
    """End-of-sequence ids: the tokenizer's and those of the model's generation config."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else configured)
    return ids
