"""The PyTorch engine: chunk KV precompute, fusion, decoding and streaming over one loaded model."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..blend.controller import LoadingController
from ..blend.fusor import FusionResult, Fusor
from ..blend.methods import MethodSpec, RecomputeMethod, resolve_method, reuse_of
from ..blend.segments import ChunkKV, ChunkKVSource, Segment
from ..errors import ContextLengthError, CorruptKVError, StoreError
from ..models.loader import load_model
from ..models.runtime import LayerwiseModel
from ..settings import get_settings
from ..store.kvstore import KVStore
from ..store.pipeline import PipelinedLayerLoader
from .prompt import ChunkRef, PromptBuilder, PromptPart, layout_segments
from .sampling import SamplingParams, make_generator, sample_next
from .textstream import TextStream

log = logging.getLogger(__name__)


@dataclass
class GenerationResult:
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

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TokenEvent:
    """One generated token while streaming: its id and the text it adds."""

    token_id: int
    text: str


class Engine:
    """Owns the model, the fusor and the chunk KV store; thread-safe (one forward at a time)."""

    def __init__(
        self,
        model: LayerwiseModel | str | Path | None = None,
        store: KVStore | str | Path | None = None,
        prompt_builder: PromptBuilder | None = None,
    ) -> None:
        settings = get_settings()
        self.model = model if isinstance(model, LayerwiseModel) else load_model(model)
        if not isinstance(store, KVStore):
            root = Path(store) if store is not None else settings.home / "kv" / self.model.fingerprint[:16]
            store = KVStore(root, self.model.fingerprint, self.model.shape)
        self.store = store
        self.fusor = Fusor(self.model)
        self.prompts = prompt_builder or PromptBuilder(self.model.tokenizer)
        self._lock = threading.RLock()  # the model's forward is not re-entrant across threads
        self.eos_ids = _eos_ids(self.model)
        self.controller = LoadingController.for_model(self.model)

    # -- chunk KV ------------------------------------------------------------------------------------

    def precompute(self, token_ids: Sequence[int]) -> ChunkKV:
        """Prefill a chunk alone at positions 0..n-1 (no BOS) and return its per-layer K/V."""
        n = len(token_ids)
        if n == 0:
            raise ValueError("cannot precompute KV of an empty chunk")
        if n > self.model.shape.max_context:
            raise ContextLengthError(
                f"chunk of {n} tokens exceeds the context of {self.model.shape.max_context}"
            )
        with self._lock:
            _, cache = self.model.prefill(list(token_ids))
        return ChunkKV(
            [k[0, :, :n].clone() for k in cache.keys],
            [v[0, :, :n].clone() for v in cache.values],
            self.model.fingerprint,
        )

    def chunk_kv(self, token_ids: Sequence[int]) -> ChunkKVSource:
        """The chunk's KV from the store, computed and written back on a miss."""
        key = self.store.key_for(token_ids)
        found = self.store.get(key)
        if found is not None:
            return found
        kv = self.precompute(token_ids)
        try:
            self.store.put(key, kv)
        except StoreError as exc:
            # A store that cannot keep the chunk (read-only, disk full) costs a recompute next time, not
            # this answer.
            log.warning("chunk KV %s… was computed but not stored: %s", key[:16], exc)
        # Serve what the store holds (its dtype), so a first answer equals every later one.
        return kv.to(self.store.kv_dtype)

    def ensure_chunk_kv(self, token_ids: Sequence[int]) -> int:
        """Precompute and store a chunk's KV unless present; returns the bytes written (0 if present)."""
        key = self.store.key_for(token_ids)
        if self.store.contains(key):
            return 0
        return self.store.put(key, self.precompute(token_ids))

    # -- building requests ---------------------------------------------------------------------------

    def rag_segments(
        self, question: str, chunks: Sequence[ChunkRef], method: str | MethodSpec | RecomputeMethod
    ) -> list[Segment]:
        """Segments for a RAG prompt, with the KV ``method`` reuses attached (see :func:`layout_segments`)."""
        if not question.strip():
            raise ValueError("the question is empty")
        return self.segments(self.prompts.rag_parts(question, chunks), method)

    def segments(
        self, parts: Sequence[PromptPart], method: str | MethodSpec | RecomputeMethod
    ) -> list[Segment]:
        """Segments of a prompt laid out as fresh token runs and chunks, with the KV ``method`` reuses
        (from the store, computed and stored on a miss)."""
        return layout_segments(parts, reuse_of(method), self.chunk_kv)

    def chat_segments(self, messages: Sequence[dict]) -> list[Segment]:
        return [Segment.fresh(self.prompts.chat_ids(messages))]

    # -- fusion and generation -----------------------------------------------------------------------

    def fuse(
        self, segments: list[Segment], method: RecomputeMethod, extra_capacity: int = 0, observer=None
    ) -> FusionResult:
        """Fuse with the store's pipelined loader. A chunk found corrupt while loading is recomputed,
        rewritten and the fusion retried once."""
        for attempt in (1, 2):
            sources = [s.kv for s in segments if s.kv is not None]
            loader = PipelinedLayerLoader(sources, dtype=self.model.dtype, device=self.model.device)
            try:
                with self._lock:
                    return self.fusor.fuse(segments, method, loader, extra_capacity, observer)
            except CorruptKVError as exc:
                if attempt == 2:
                    raise
                log.warning("chunk KV %s is corrupt (%s); recomputing it", exc.key, exc)
                segments = [
                    Segment.cached(s.token_ids, self.chunk_kv(s.token_ids), s.chunk_id)
                    if s.kv is not None
                    else s
                    for s in segments
                ]
        raise AssertionError("unreachable")

    def stream(
        self,
        segments: list[Segment],
        method: str | MethodSpec | RecomputeMethod = "cacheblend",
        sampling: SamplingParams | None = None,
        result: list[GenerationResult] | None = None,
        **method_options,
    ) -> Iterator[TokenEvent]:
        """Yield tokens as they are generated; the final :class:`GenerationResult` is appended to
        ``result`` when given."""
        started = time.perf_counter()
        sampling = sampling or SamplingParams()
        prompt_tokens = sum(len(s) for s in segments)
        resolved = resolve_method(method, segments, self.controller, method_options)
        recompute = resolved.method
        room = self.model.shape.max_context - prompt_tokens
        if room < 1:
            raise ContextLengthError(
                f"prompt of {prompt_tokens} tokens leaves no room to generate within the model's context of "
                f"{self.model.shape.max_context} tokens"
            )
        max_new = min(sampling.max_new_tokens, room)
        fusion = self.fuse(segments, recompute, extra_capacity=max_new)
        generator = make_generator(sampling)
        answer = TextStream(self.model.tokenizer, self.eos_ids, sampling.stop, max_new)
        cache, logits, position, ttft = fusion.cache, fusion.logits, prompt_tokens, 0.0
        while True:
            token = sample_next(logits, sampling, generator)
            if not answer.token_ids:
                ttft = time.perf_counter() - started
            piece = answer.push(token)
            if piece is not None:
                yield TokenEvent(token, piece)
            if answer.finished:
                break
            with self._lock:
                logits = self.model.forward(
                    torch.tensor([[token]], device=self.model.device),
                    torch.tensor([position], device=self.model.device),
                    cache,
                )[0]
            position += 1
        if result is not None:
            result.append(
                GenerationResult(
                    text=answer.text,
                    token_ids=answer.token_ids,
                    method=recompute.name,
                    finish_reason=answer.finish_reason or "length",
                    ttft_s=ttft,
                    total_s=time.perf_counter() - started,
                    prompt_tokens=prompt_tokens,
                    reused_tokens=fusion.reused_tokens,
                    computed_tokens=fusion.computed_tokens,
                    recompute_ratio=fusion.recompute_ratio,
                    chunk_ids=[s.chunk_id for s in segments if s.chunk_id],
                    method_options=recompute.describe(),
                    load_wait_s=fusion.load_wait_s,
                    controller=resolved.controller,
                )
            )

    def generate(
        self,
        segments: list[Segment],
        method: str | MethodSpec | RecomputeMethod = "cacheblend",
        sampling: SamplingParams | None = None,
        **method_options,
    ) -> GenerationResult:
        """Fuse ``segments`` with ``method`` and generate an answer."""
        result: list[GenerationResult] = []
        for _ in self.stream(segments, method, sampling, result, **method_options):
            pass
        return result[0]


def _eos_ids(model: LayerwiseModel) -> set[int]:
    ids = set()
    tokenizer_eos = model.tokenizer.eos_token_id
    if tokenizer_eos is not None:
        ids.add(int(tokenizer_eos))
    config_eos = getattr(model.hf_model.generation_config, "eos_token_id", None)
    if config_eos is not None:
        ids.update([config_eos] if isinstance(config_eos, int) else config_eos)
    return ids
