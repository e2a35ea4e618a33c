"""The PyTorch engine: chunk KV precompute, fusion, decoding and streaming over one loaded model."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from ..blend.controller import LoadingController
from ..blend.fusor import FusionRequest, FusionResult, FusionRoute, Fusor
from ..blend.methods import RecomputeMethod, Reuse
from ..blend.round import fuse_round
from ..blend.segments import (
    NO_CONTEXT,
    ChunkContext,
    ChunkKV,
    ChunkKVSource,
    LayerKVProvider,
    Segment,
    kv_sources,
    prefill_chunk_kv,
    prefill_context,
)
from ..blend.spec import reuse_of
from ..config import DEFAULTS, Config
from ..errors import ContextLengthError, CorruptKVError, EngineClosedError, StoreError
from ..models.runtime import KVCache, LayerwiseModel
from ..models.shared import acquire_model, release_model
from ..models.tokenizer import chunk_context_ids
from ..store.exact import ExactKVFiles
from ..store.index import folder_codec
from ..store.joined import JoinedLayerKV
from ..store.kvstore import KVStore
from ..store.pipeline import PipelinedLayerLoader, worth_prefetching
from ..store.shared import KVStoreOptions, acquire_store, release_store
from .base import GenerationResult, Method, PromptSegments, Submitting, eos_token_ids
from .handles import RequestHandle
from .prompt import PromptBuilder, PromptPart, layout_segments
from .request import GenerationRequest
from .scheduler import BatchScheduler
from .single_flight import flights_of

log = logging.getLogger(__name__)

# Template openings whose exact KV an engine keeps in memory (a few KB per token each).
MAX_EXACT_HEADS = 16


class Engine(PromptSegments, Submitting):
    """Runs the model and the fusor over a chunk KV store (``store``: a corpus's, ``corpus.kv_store``, or
    a folder whose process-wide store it opens); implements
    :class:`~cacheblend_rag.engine.base.EngineProtocol`. Thread-safe: one forward at a time, under
    :attr:`forward_lock`. Every answer goes through :meth:`submit` (``generate``, ``stream`` and
    :meth:`generate_batch` call it): the engine's one :class:`BatchScheduler` (:attr:`scheduler`), where
    concurrent callers are fused and decoded together.

    ``config`` gives what the caller did not: how a model named is loaded (device, dtype, threads, cache
    directory), the default chunk context, the default store folder with its codec, budgets and remote
    tier, and the loading controller's ratio floor. The edges pass their settings; the default is
    :data:`~cacheblend_rag.config.DEFAULTS`."""

    batches_requests = False

    def __init__(
        self,
        model: LayerwiseModel | str | Path | None = None,
        store: KVStore | str | Path | None = None,
        prompt_builder: PromptBuilder | None = None,
        chunk_context: ChunkContext | None = None,
        kv_dtype: str | None = None,
        config: Config = DEFAULTS,
    ) -> None:
        # A model named (or the default) is the process's shared copy (one load per model and device),
        # given back by close(); a model object passed in stays its owner's.
        self.config = config  # also the batch limits of generate_batch
        self._owns_model = not isinstance(model, LayerwiseModel)
        self.model = acquire_model(model, config=config) if self._owns_model else model
        # What chunks are prefilled behind (docs/fusor.md); a corpus passes the one it was built with.
        if chunk_context is None:
            chunk_context = ChunkContext(chunk_context_ids(self.model.tokenizer, config.chunk_context))
        self.chunk_context = chunk_context
        self._context_cache: KVCache | None = None
        # template openings seen lately, by token ids: their exact KV (see exact_head)
        self._heads: OrderedDict[tuple[int, ...], ChunkKV] = OrderedDict()
        self._heads_lock = threading.Lock()
        # A store given is its owner's (a corpus passes its own, Corpus.kv_store); a folder (or the
        # default) is opened as the process's shared store there and given back by close().
        self._owns_store = not isinstance(store, KVStore)
        if self._owns_store:
            root = Path(store) if store is not None else config.home / "kv" / self.model.fingerprint[:16]
            codec = folder_codec(root, self.model.fingerprint, kv_dtype, config.kv_dtype)
            options = KVStoreOptions.of(config).store_kwargs()
            store = acquire_store(root, self.model.fingerprint, self.model.shape, codec, **options)
        self.store = store
        # concurrent requests missing the same KV compute it once (shared by the engines over this store)
        self._flights = flights_of(store)
        # openings' exact KV, kept beside the chunks in full precision (a chunk codec would round it)
        self.exact_files = ExactKVFiles(
            store.root,
            self.model.fingerprint,
            self.model.shape,
            self.model.dtype,
            torch.device(self.model.device).type,
            writable=not store.read_only,
        )
        static = {"auto": None, "static": True, "layers": False}[config.fusion]
        compile_mode = None if config.fusion_compile == "none" else config.fusion_compile
        self.fusor = Fusor(self.model, static=static, compile_mode=compile_mode)
        self.prompts = prompt_builder or PromptBuilder(self.model.tokenizer)
        # The model's forward is not re-entrant across threads: every forward (prefill, fusion, decode
        # step, here or in a BatchScheduler) holds this lock, the model's own, so engines sharing a
        # model take turns too.
        self.forward_lock = self.model.forward_lock
        self.eos_ids = eos_token_ids(
            self.model.tokenizer, getattr(self.model.hf_model.generation_config, "eos_token_id", None)
        )
        self.controller = LoadingController.for_model(self.model, config.ratio, config.home)
        self._scheduler: BatchScheduler | None = None
        self._scheduler_lock = threading.Lock()
        self._closed = False

    @property
    def context_window(self) -> int:
        return self.model.shape.max_context

    def close(self) -> None:
        """Give back the chunk KV store this engine opened (the last holder closes it, waiting for its
        background writes) and the shared model it loaded (the last engine to do so frees it). A store or
        model passed in stays open: it is its owner's. Requests already submitted are served first."""
        with self._scheduler_lock:
            self._closed = True
            scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler.close()
        if self._owns_store:
            self._owns_store = False
            release_store(self.store)
        if self._owns_model:
            self._owns_model = False
            release_model(self.model)

    # -- chunk KV ------------------------------------------------------------------------------------

    def precompute(self, token_ids: Sequence[int], context: ChunkContext | None = None) -> ChunkKV:
        """Prefill a chunk behind ``context`` (default: the engine's chunk context) and return its
        per-layer K/V, keys rotated to the chunk's own positions 0..n-1."""
        context = self.chunk_context if context is None else context
        n = len(token_ids)
        if n == 0:
            raise ValueError("cannot precompute KV of an empty chunk")
        if n + len(context) > self.model.shape.max_context:
            raise ContextLengthError(
                f"chunk of {n} tokens (behind a {len(context)}-token chunk context) exceeds the context "
                f"of {self.model.shape.max_context}"
            )
        with self.forward_lock:
            shared = None
            if context == self.chunk_context and len(context):
                if self._context_cache is None:
                    self._context_cache = prefill_context(self.model, context)
                shared = self._context_cache
            return prefill_chunk_kv(self.model, token_ids, context, shared)

    def chunk_key(self, token_ids: Sequence[int]) -> str:
        """The KV store key of the chunk made of ``token_ids`` (prefilled behind the chunk context)."""
        return self.store.chunk_key(token_ids, self.chunk_context.key)

    def chunk_kv(self, token_ids: Sequence[int]) -> ChunkKVSource:
        """The chunk's KV from the store, computed and written back on a miss."""
        return self._stored_kv(token_ids, self.chunk_context)[0]

    def prefix_kv(self, token_ids: Sequence[int]) -> ChunkKVSource:
        """The KV of a prompt's own prefix as a prefix cache holds it: prefilled alone from position 0
        (what ``prefix_cache`` reuses), from the store or computed and written back."""
        return self._stored_kv(token_ids, NO_CONTEXT)[0]

    def _chunk_lookup(self, token_ids: Sequence[int]) -> tuple[ChunkKVSource, bool]:
        return self._stored_kv(token_ids, self.chunk_context)

    def _prefix_lookup(self, token_ids: Sequence[int]) -> tuple[ChunkKVSource, bool]:
        return self._stored_kv(token_ids, NO_CONTEXT)

    def _stored_kv(self, token_ids: Sequence[int], context: ChunkContext) -> tuple[ChunkKVSource, bool]:
        """The KV from the store, and whether it was computed here because no tier held it. Concurrent
        requests missing the same key compute it once: the others wait and read what it computed (for
        them, KV read, not computed)."""
        key = self.store.chunk_key(token_ids, context.key)
        found = self.store.get(key)
        if found is not None:
            return found, False
        (kv, computed), led = self._flights.run(key, lambda: self._compute_kv(key, token_ids, context))
        return kv, computed and led

    def _compute_kv(
        self, key: str, token_ids: Sequence[int], context: ChunkContext
    ) -> tuple[ChunkKVSource, bool]:
        # a computation that finished between our miss and this flight's start has stored it already
        found = self.store.get(key)
        if found is not None:
            return found, False
        # Serve what the store holds (its codec, decoded), so a first answer equals every later one.
        stored = self.store.encode(key, self.precompute(token_ids, context))
        try:
            self.store.put(key, stored, pinned=False)  # request traffic: evictable in a remote tier
        except StoreError as exc:
            # A store that cannot keep the chunk (read-only, disk full) costs a recompute next time, not
            # this answer.
            log.warning("chunk KV %s… was computed but not stored: %s", key[:16], exc)
        return stored, True

    def ensure_chunk_kv(self, token_ids: Sequence[int]) -> int:
        """Precompute and store a chunk's KV unless present (locally or in the remote tier) as corpus KV;
        returns the bytes written (0 if present)."""
        key = self.chunk_key(token_ids)
        if self.store.contains(key):
            self.store.pin(key)  # a shared remote tier holds corpus KV too, never evicted there
            return 0
        return self.store.put(key, self.precompute(token_ids))

    # -- building requests ---------------------------------------------------------------------------

    def segments(self, parts: Sequence[PromptPart], method: Method | Reuse) -> list[Segment]:
        """Segments of a prompt laid out as fresh token runs and chunks, with the KV ``method`` reuses
        (from the store, computed and stored on a miss)."""
        reuses = reuse_of(method)
        if reuses is Reuse.PREFIX:
            return layout_segments(parts, reuses, self._prefix_lookup)
        return self.exact_head(layout_segments(parts, reuses, self._chunk_lookup), reuses)

    def exact_head(self, segments: list[Segment], reuses: Reuse) -> list[Segment]:
        """The fresh text before the first chunk (a template's opening: system prompt, "Passages:") is the
        same in every prompt of the template, and its KV does not depend on what follows. Computed once
        from position 0 and kept in the compute dtype (in memory, and on disk beside the store's chunks
        for the next process: :mod:`~cacheblend_rag.store.exact`), it is exactly what a full prefill
        computes there, so a method that reuses chunks (``reuses``) reuses it as an exact segment (as
        vLLM's prefix caching would); any other method gets ``segments`` back. vLLM's worker applies the
        same rule to the prompts it blends (engine/vllm/worker.py)."""
        if reuses is not Reuse.CHUNKS:
            return segments
        if len(segments) < 2 or segments[0].is_cached or not any(s.is_cached for s in segments[1:]):
            return segments
        ids = segments[0].token_ids
        kv, computed = self._opening_kv(ids)
        return [Segment.cached(ids, kv, exact=True, computed=computed), *segments[1:]]

    def warm_opening(self) -> None:
        """Have the engine's own RAG template's opening ready (read from the store's exact files, else
        computed and written there) before any request: a server's first request then reads it like
        every later one, so its counts are those of the request, not of coming first."""
        opening, _, _ = self.prompts.rag_frame("?")  # (the text before the passages: any question)
        if opening:
            self._opening_kv(tuple(opening))

    def _opening_kv(self, ids: tuple[int, ...]) -> tuple[ChunkKV, bool]:
        """An opening's exact KV and whether this call computed it (concurrent callers compute it once)."""
        with self._heads_lock:
            kv = self._heads.get(ids)
            if kv is not None:
                self._heads.move_to_end(ids)
                return kv, False
        (kv, computed), led = self._flights.run(self.exact_files.key(ids), lambda: self._head_kv(ids))
        return kv, computed and led

    def _head_kv(self, ids: tuple[int, ...]) -> tuple[ChunkKV, bool]:
        """An opening's exact KV: kept in memory, else read from the store's exact files (another process
        or engine computed it), else computed and written there; and whether it was computed."""
        with self._heads_lock:
            kv = self._heads.get(ids)  # a concurrent computation may have just finished
        computed = False
        if kv is None:
            stored = self.exact_files.get(ids)
            if stored is not None:
                kv = ChunkKV(
                    [k.to(self.model.device) for k in stored.keys],
                    [v.to(self.model.device) for v in stored.values],
                    stored.fingerprint,
                )
            else:
                with self.forward_lock:
                    kv = prefill_chunk_kv(self.model, ids)
                self.exact_files.put(ids, kv)
                computed = True
        with self._heads_lock:
            self._heads[ids] = kv
            self._heads.move_to_end(ids)
            while len(self._heads) > MAX_EXACT_HEADS:
                self._heads.popitem(last=False)
        return kv, computed

    # -- fusion --------------------------------------------------------------------------------------

    def fuse(self, segments: list[Segment], method: RecomputeMethod, extra_capacity: int = 0) -> FusionResult:
        """Fuse one prompt as the scheduler fuses a request (:meth:`fuse_group`), with room for
        ``extra_capacity`` more tokens in its cache; raises its failure."""
        fused = self.fuse_group([FusionRequest(segments, method, extra_capacity=extra_capacity)])[0]
        if isinstance(fused, Exception):
            raise fused
        return fused

    def fuse_group(
        self, requests: Sequence[FusionRequest], rounds: bool = False
    ) -> list[FusionResult | Exception]:
        """Fuse an admission group's prompts: each routed once (:meth:`Fusor.route`), those on the static
        steps each by them, the others together (one projection and one MLP per layer over all their
        tokens), and with ``rounds`` those that read the same chunks sharing one blend of them
        (:mod:`~cacheblend_rag.blend.round`; a layer-pass feature). Each result equals fusing its prompt
        alone. If fusing them together fails (bad input, corrupt KV), they are fused one at a time, so
        one request's problem stays its own: each request's result or exception, in order."""
        try:
            return self._fuse_retrying(requests, rounds)
        except Exception as exc:  # each request is retried alone below and fails on its own
            if len(requests) == 1:
                return [exc]
            log.info("fusing %d requests together failed (%s); fusing them one at a time", len(requests), exc)
        out: list[FusionResult | Exception] = []
        for request in requests:
            try:
                out.extend(self._fuse_retrying([request], rounds=False))
            except Exception as exc:  # handed to the caller in its request's place
                out.append(exc)
        return out

    def _fuse_retrying(self, requests: Sequence[FusionRequest], rounds: bool) -> list[FusionResult]:
        """:meth:`_fuse_routes`; a chunk found corrupt while loading is recomputed, rewritten and the
        fusion retried once (the corrupt copy was removed from its tier)."""
        try:
            return self._fuse_routes(requests, rounds)
        except CorruptKVError as exc:
            log.warning("chunk KV %s is corrupt (%s); recomputing it", exc.key, exc)
        return self._fuse_routes([self._refetched(r) for r in requests], rounds)

    def _fuse_routes(self, requests: Sequence[FusionRequest], rounds: bool) -> list[FusionResult]:
        routes = [self.fusor.route(request) for request in requests]
        # rounds are a layer-pass feature: the requests on the layer passes, when two or more
        rounded = [i for i, route in enumerate(routes) if rounds and not route.static]
        rounded = rounded if len(rounded) > 1 else []
        own = [i for i in range(len(routes)) if i not in rounded]
        results: dict[int, FusionResult] = {}
        with self.forward_lock:
            if rounded:
                # no loader per request here: fuse_round makes one for each blend it runs and for each
                # request fused on its own (a round's members read nothing of their own)
                fused = fuse_round(self.fusor, [routes[i] for i in rounded], self._loader)
                results.update(zip(rounded, fused, strict=True))
            if own:
                fused = self.fusor.fuse_routes([self._with_loader(routes[i]) for i in own])
                results.update(zip(own, fused, strict=True))
        return [results[i] for i in range(len(routes))]

    def _with_loader(self, route: FusionRoute) -> FusionRoute:
        """``route`` with the loader its path reads chunks with: on the static steps, RAM-resident chunks
        decoded together per layer where they can be; else the store's pipelined loader."""
        sources = kv_sources(route.request.segments)
        if route.static and JoinedLayerKV.serves(sources):
            loader: LayerKVProvider = JoinedLayerKV(sources, self.model.dtype, self.model.device)
        else:
            loader = self._loader(sources)
        return replace(route, request=replace(route.request, kv_provider=loader))

    def _refetched(self, request: FusionRequest) -> FusionRequest:
        """``request`` with each cached chunk's KV looked up again: a chunk found corrupt was removed
        from its tier, so it is read from another or recomputed and stored."""
        kv_for = self.prefix_kv if request.method.reuses is Reuse.PREFIX else self.chunk_kv
        segments = [
            Segment.cached(s.token_ids, kv_for(s.token_ids), s.chunk_id)
            if s.kv is not None and not s.exact  # an exact head lives in memory, never corrupt
            else s
            for s in request.segments
        ]
        return replace(request, segments=segments)

    def _loader(self, sources: Sequence[ChunkKVSource]) -> PipelinedLayerLoader:
        device = self.model.device
        prefetch = worth_prefetching(sources, device)
        return PipelinedLayerLoader(list(sources), dtype=self.model.dtype, device=device, prefetch=prefetch)

    # -- generation ----------------------------------------------------------------------------------

    @property
    def scheduler(self) -> BatchScheduler:
        """The batch scheduler every request served with others goes through (:meth:`submit`,
        :meth:`generate_batch`), with ``config``'s batch limits; started on first use, closed by
        :meth:`close`. One per engine, so that concurrent callers meet in one decode batch."""
        with self._scheduler_lock:
            if self._closed:
                raise EngineClosedError("this engine is closed (its model was given back)")
            if self._scheduler is None:
                self._scheduler = BatchScheduler.of(self, self.config)
            return self._scheduler

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue ``request`` in :attr:`scheduler`, decoded together with concurrent ones; returns its
        handle at once (iterate it for tokens, then ``.result()``; ``.cancel()`` from any thread). Every
        answer goes through here. Bad input raises here."""
        return self.scheduler.submit(request)

    def generate_batch(
        self,
        requests: Sequence[GenerationRequest],
        max_batch: int | None = None,
        rounds: bool | None = None,
        kv_budget_bytes: int | None = None,
    ) -> list[GenerationResult]:
        """Serve ``requests`` together through a :class:`BatchScheduler`: :attr:`scheduler`, or, when
        limits are given (``max_batch`` rows at most, ``rounds``, ``kv_budget_bytes``), one of their own
        for these requests; results in order. Requests admitted together that read the same chunks share
        one blend of them (``rounds``, default: ``config.batch_rounds``); other greedy answers equal
        :meth:`generate`'s."""
        if max_batch is None and rounds is None and kv_budget_bytes is None:
            return self.scheduler.generate_batch(requests)
        with BatchScheduler.of(
            self, self.config, max_batch=max_batch, rounds=rounds, kv_budget_bytes=kv_budget_bytes
        ) as scheduler:
            return scheduler.generate_batch(requests)

    def generate_round(
        self, requests: Sequence[GenerationRequest], kv_budget_bytes: int | None = None
    ) -> list[GenerationResult]:
        """Answer ``requests`` (agents reading the same chunks, each with its own text around them) as one
        round: admitted together, as far as the decode batch's KV budget allows, so that their common
        chunks are blended once for all of them (:mod:`~cacheblend_rag.blend.round`). Each result
        reports its round: ``round_requests``, ``round_shared_tokens``, ``round_recomputed_tokens``."""
        return self.generate_batch(
            requests, max_batch=max(1, len(requests)), rounds=True, kv_budget_bytes=kv_budget_bytes
        )
