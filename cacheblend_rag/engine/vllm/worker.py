"""What runs inside a vLLM worker process: the fusor over vLLM's own model, the chunk KV store.

One :class:`WorkerBlender` per worker process, started by the first ``cacheblend_start`` RPC (which
:class:`VLLMEngine` sends as soon as vLLM is up) from vLLM's loaded model, and shared by the connector
(which fuses and writes KV) and by :class:`CacheBlendWorkerExtension`, the RPC surface :class:`VLLMEngine`
calls through ``LLM.collective_rpc`` (start, chunk precompute, per-request accounting, memory).

The fusor runs on vLLM's own modules (:mod:`.weights`): no second copy of the weights. Only when their
layout is not one :mod:`.weights` knows (or ``share_weights`` is off, for measurement) does the worker load
its own copy of the model, and it logs why.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...blend.fusor import FusionResult
from ...blend.methods import get_method
from ...blend.segments import ChunkContext, Segment
from ...config import DEFAULTS, Config
from ...errors import CacheBlendError
from ...models.loader import load_model
from ...models.runtime import LayerwiseModel
from ...store.kvstore import KVStore
from ...store.shared import KVStoreOptions
from ..engine import Engine
from .paged import PagedLayerwiseModel, PagedTarget
from .protocol import BlendRequest
from .weights import UnknownLayoutError, layerwise_over_vllm, sharing_report

log = logging.getLogger(__name__)

# Accounting of finished blends waiting for the engine to collect it; old entries are dropped so that
# requests nobody asks about (aborted ones) cannot grow it without bound.
MAX_KEPT_STATS = 4096
SHARED, COPY = "vllm", "copy"  # where the fusor's weights come from: vLLM's modules, or our own load

_blender: WorkerBlender | None = None
_blender_lock = threading.Lock()


def fusion_model(
    config: dict[str, Any], vllm_model: nn.Module, dtype: torch.dtype
) -> tuple[LayerwiseModel, str]:
    """The model the fusor runs on and where its weights come from (:data:`SHARED` or :data:`COPY`):
    vLLM's own modules when their layout is known, else our own copy of the model. ``config``: the
    connector's extra config (``model``; ``home``, the cache directory, and ``fusion_attention``, which
    kernel attends a scattered selection, when the engine sent them)."""
    path = Path(config["model"])
    values = Config(home=Path(config["home"])) if config.get("home") else DEFAULTS
    if config.get("share_weights", True):
        try:
            attention = config.get("fusion_attention", "auto")
            return layerwise_over_vllm(vllm_model, path, dtype, values.home, attention), SHARED
        except UnknownLayoutError as exc:
            log.warning(
                "CacheBlend fusion loads its own copy of %s (a second copy of the weights): vLLM's %s is "
                "not laid out as expected: %s",
                path.name,
                type(vllm_model).__name__,
                exc,
            )
    else:
        log.info("CacheBlend fusion loads its own copy of %s: share_weights is off", path.name)
    device = next(vllm_model.parameters()).device
    # vLLM sized this process's thread pool for serving; loading our model must not change it.
    threads = torch.get_num_threads()
    try:
        layerwise = load_model(
            path, device=str(device), dtype=str(dtype).removeprefix("torch."), config=values
        )
    finally:
        torch.set_num_threads(threads)
    return layerwise, COPY


def resident_memory() -> dict[str, int]:
    """This process's resident memory in bytes: ``rss_bytes``, and on Linux its anonymous and file-backed
    parts (``rss_anon_bytes``, ``rss_file_bytes``: a checkpoint memory-mapped by transformers counts as
    file-backed). Heap memory freed but kept by the C allocator is handed back first (``malloc_trim``),
    so the reading counts memory in use, not the high-water mark of earlier activations."""
    import psutil  # a dependency of vLLM

    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    memory = {"rss_bytes": int(psutil.Process().memory_info().rss)}
    try:
        status = Path("/proc/self/status").read_text().splitlines()
    except OSError:  # not Linux
        return memory
    fields = {"RssAnon:": "rss_anon_bytes", "RssFile:": "rss_file_bytes"}
    for line in status:
        name, *value = line.split()
        if name in fields and value:
            memory[fields[name]] = int(value[0]) * 1024  # reported in kB
    return memory


class WorkerBlender:
    """Fuses blend requests with a layer-wise model over the engine's chunk KV store."""

    def __init__(
        self,
        model: LayerwiseModel,
        weights: str,
        store: str,
        kv_dtype: str,
        chunk_context: Sequence[int] = (),
        store_options: KVStoreOptions | None = None,
    ) -> None:
        self.weights = weights
        options = (store_options or KVStoreOptions()).store_kwargs()  # the driver's budgets, remote tier
        self.engine = Engine(
            model,
            store=KVStore(Path(store), model.fingerprint, model.shape, kv_dtype, **options),
            chunk_context=ChunkContext(tuple(chunk_context)),  # the driver's: both key chunks alike
        )
        self._stats: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._stats_lock = threading.Lock()

    @property
    def shape(self):
        return self.engine.model.shape

    def blend(
        self, request: BlendRequest, token_ids: Sequence[int], target: PagedTarget | None = None
    ) -> FusionResult:
        """Fuse the whole prompt as the PyTorch engine would (chunk KV from the store, computed and stored
        on a miss) and the template's opening reused exactly (``Engine.exact_head``), so the blended
        span's KV is exactly the PyTorch engine's. With ``target`` (vLLM's CPU
        backend, :mod:`.paged`), the fusion writes each layer's K/V into those blocks of vLLM's cache and
        attends its rows there with vLLM's kernel."""
        segments = [
            Segment.cached(ids, self.engine.chunk_kv(ids)) if is_cached else Segment.fresh(ids)
            for ids, is_cached in request.split(token_ids)
        ]
        method = get_method(request.method, **request.method_options)
        segments = self.engine.exact_head(segments, method.reuses)  # as the PyTorch engine reuses it
        model = self.engine.model
        if target is None or not isinstance(model, PagedLayerwiseModel):
            return self.engine.fuse(segments, method)
        with model.forward_lock:
            model.target = target
            try:
                return self.engine.fuse(segments, method)
            finally:
                model.target = None

    @property
    def pages(self) -> bool:
        """Whether fusion can write into vLLM's paged cache and attend there (:mod:`.paged`)."""
        return isinstance(self.engine.model, PagedLayerwiseModel)

    def attention_report(self) -> dict[str, Any]:
        """Which kernel attends scattered selections, by size, and what each cost when timed
        (:meth:`.paged.AttentionChoice.report`; empty when fusion does not attend in the paged cache)."""
        model = self.engine.model
        return model.attention_choice.report() if isinstance(model, PagedLayerwiseModel) else {}

    def ensure_chunks(self, chunks: Sequence[Sequence[int]]) -> int:
        """Precompute and store every chunk not yet in the store; returns the bytes written."""
        return sum(self.engine.ensure_chunk_kv(ids) for ids in chunks)

    def record(self, request_key: str, stats: dict[str, Any]) -> None:
        with self._stats_lock:
            self._stats[request_key] = stats
            while len(self._stats) > MAX_KEPT_STATS:
                self._stats.popitem(last=False)

    def take_stats(self, request_keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        with self._stats_lock:
            return {key: self._stats.pop(key) for key in request_keys if key in self._stats}


def start_blender(config: dict[str, Any], vllm_model: nn.Module, dtype: torch.dtype) -> WorkerBlender:
    """Create this process's blender (once) from the connector's ``kv_connector_extra_config`` and vLLM's
    loaded model (see :func:`create_blender`)."""
    global _blender
    with _blender_lock:
        if _blender is None:
            _blender = create_blender(config, vllm_model, dtype)
        return _blender


def create_blender(config: dict[str, Any], vllm_model: nn.Module, dtype: torch.dtype) -> WorkerBlender:
    """A blender over the store the connector's ``kv_connector_extra_config`` names (``config``), with the
    driver's codec, tier budgets, remote tier and chunk context from there too: the worker reads no
    settings or environment of its own."""
    model, weights = fusion_model(config, vllm_model, dtype)
    store_options = KVStoreOptions(
        config.get("ram_budget_bytes"), config.get("disk_budget_bytes"), config.get("kv_remote")
    )
    return WorkerBlender(
        model, weights, config["store"], config["kv_dtype"], config.get("chunk_context", ()), store_options
    )


def current_blender() -> WorkerBlender:
    if _blender is None:
        raise CacheBlendError(
            "this vLLM worker has no CacheBlend state: the engine was not started by VLLMEngine (the "
            "CacheBlend KV connector with its worker extension, whose cacheblend_start RPC creates it)"
        )
    return _blender


def record_failure(request_key: str, error: BaseException) -> None:
    """Report a blend that failed, for the engine to collect (nothing to report to without a blender)."""
    if _blender is not None:
        _blender.record(request_key, {"error": f"{type(error).__name__}: {error}"})


class CacheBlendWorkerExtension:
    """Methods added to vLLM's worker class (``worker_extension_cls``), called by name through
    ``LLM.collective_rpc``. Arguments and results are plain lists and dicts. vLLM refuses an extension
    that defines a name its worker has, so ``vllm_config`` and ``get_model`` are the worker's own."""

    def cacheblend_start(self) -> dict[str, Any]:
        """Start the blender over this worker's loaded model: its shape, where its weights come from, and
        this process's id and resident memory."""
        extra = dict(self.vllm_config.kv_transfer_config.kv_connector_extra_config)  # type: ignore[attr-defined]
        blender = start_blender(extra, self.get_model(), self.vllm_config.model_config.dtype)  # type: ignore[attr-defined]
        return {"shape": asdict(blender.shape), "weights": blender.weights, **self.cacheblend_memory()}

    def cacheblend_weights(self) -> dict[str, Any]:
        """Where the fusor's weights come from, and how many of its tensors share storage with vLLM's."""
        blender = current_blender()
        report = sharing_report(blender.engine.model, self.get_model())  # type: ignore[attr-defined]
        return {"weights": blender.weights, **report}

    def cacheblend_memory(self) -> dict[str, int]:
        return {"pid": os.getpid(), **resident_memory()}

    def cacheblend_ensure_chunks(self, chunks: list[list[int]]) -> int:
        return current_blender().ensure_chunks(chunks)

    def cacheblend_take_stats(self, request_keys: list[str]) -> dict[str, dict[str, Any]]:
        return current_blender().take_stats(request_keys)
