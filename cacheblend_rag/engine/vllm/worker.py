"""What runs inside a vLLM worker process: our own copy of the model, the chunk KV store and the fusor.

One :class:`WorkerBlender` per worker process, created when the connector registers vLLM's KV caches (so
it knows their device), shared by the connector (which fuses and writes KV) and by
:class:`CacheBlendWorkerExtension`, the RPC surface :class:`VLLMEngine` calls through
``LLM.collective_rpc`` (model shape, chunk precompute, per-request accounting).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ...blend.fusor import FusionResult
from ...blend.methods import get_method
from ...blend.segments import ChunkContext, Segment
from ...errors import CacheBlendError
from ...models.loader import load_model
from ...store.kvstore import KVStore
from ..engine import Engine
from .protocol import BlendRequest

log = logging.getLogger(__name__)

# Accounting of finished blends waiting for the engine to collect it; old entries are dropped so that
# requests nobody asks about (aborted ones) cannot grow it without bound.
MAX_KEPT_STATS = 4096

_blender: WorkerBlender | None = None
_blender_lock = threading.Lock()


class WorkerBlender:
    """Fuses blend requests with our layer-wise model over the engine's chunk KV store."""

    def __init__(
        self,
        model: str,
        store: str,
        kv_dtype: str,
        device: torch.device,
        dtype: torch.dtype,
        chunk_context: Sequence[int] = (),
    ) -> None:
        # vLLM sized this process's thread pool for serving; loading our model must not change it.
        threads = torch.get_num_threads()
        try:
            layerwise = load_model(model, device=str(device), dtype=str(dtype).removeprefix("torch."))
        finally:
            torch.set_num_threads(threads)
        self.engine = Engine(
            layerwise,
            store=KVStore(Path(store), layerwise.fingerprint, layerwise.shape, kv_dtype),
            chunk_context=ChunkContext(tuple(chunk_context)),  # the driver's: both key chunks alike
        )
        self._stats: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._stats_lock = threading.Lock()

    @property
    def shape(self):
        return self.engine.model.shape

    def blend(self, request: BlendRequest, token_ids: Sequence[int]) -> FusionResult:
        """Fuse the whole prompt as the PyTorch engine would (chunk KV from the store, computed and stored
        on a miss), so the blended span's KV is exactly the PyTorch engine's."""
        segments = [
            Segment.cached(ids, self.engine.chunk_kv(ids)) if is_cached else Segment.fresh(ids)
            for ids, is_cached in request.split(token_ids)
        ]
        method = get_method(request.method, **request.method_options)
        return self.engine.fuse(segments, method)

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


def start_blender(config: dict[str, Any], device: torch.device, dtype: torch.dtype) -> WorkerBlender:
    """Create this process's blender (once) from the connector's ``kv_connector_extra_config``."""
    global _blender
    with _blender_lock:
        if _blender is None:
            _blender = WorkerBlender(
                config["model"],
                config["store"],
                config["kv_dtype"],
                device,
                dtype,
                config.get("chunk_context", ()),
            )
        return _blender


def current_blender() -> WorkerBlender:
    if _blender is None:
        raise CacheBlendError(
            "this vLLM worker has no CacheBlend state: the engine was not started with the CacheBlend "
            "KV connector (use VLLMEngine)"
        )
    return _blender


class CacheBlendWorkerExtension:
    """Methods added to vLLM's worker class (``worker_extension_cls``), called by name through
    ``LLM.collective_rpc``. Arguments and results are plain lists and dicts."""

    def cacheblend_model_shape(self) -> dict[str, Any]:
        return asdict(current_blender().shape)

    def cacheblend_ensure_chunks(self, chunks: list[list[int]]) -> int:
        return current_blender().ensure_chunks(chunks)

    def cacheblend_take_stats(self, request_keys: list[str]) -> dict[str, dict[str, Any]]:
        return current_blender().take_stats(request_keys)
