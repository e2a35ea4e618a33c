"""Engines: prefill, fusion, decoding and streaming over one model and one chunk KV store.

:class:`Engine` is the PyTorch engine; ``create_engine("vllm")`` builds the vLLM one. Both implement
:class:`EngineProtocol` (see :mod:`.base`).
"""

from pathlib import Path

from ..config import DEFAULT_ENGINE
from ..errors import EngineClosedError, SchedulerClosedError
from ..store.kvstore import KVStore
from .base import (
    EngineProtocol,
    FusionDiagnostics,
    FusionStats,
    GenerationResult,
    StreamHandle,
    TokenEvent,
    TokenStream,
)
from .constraints import JsonConstraint
from .decode import DecodeRow
from .engine import Engine
from .handles import RequestHandle
from .prompt import ChunkRef, PromptBuilder, PromptPart
from .request import EdgeTimings, GenerationRequest
from .sampling import SamplingParams
from .scheduler import BatchScheduler, SchedulerStats

ENGINE_KINDS = ("torch", "vllm")


def create_engine(
    kind: str | None = None,
    model: str | Path | None = None,
    store: KVStore | str | Path | None = None,
    **options,
) -> EngineProtocol:
    """The engine ``kind`` names over ``model`` and ``store``: ``"torch"`` (:class:`Engine`, our PyTorch
    runtime) or ``"vllm"`` (:class:`~cacheblend_rag.engine.vllm.VLLMEngine`, vLLM with the CacheBlend KV
    connector). Default: ``"torch"`` (the ``engine`` setting's default; the edges pass the setting).
    ``options`` go to the engine's constructor (``config``: the caller's settings)."""
    kind = kind or DEFAULT_ENGINE
    if kind == "torch":
        return Engine(model, store, **options)
    if kind == "vllm":
        from .vllm import VLLMEngine  # imports vLLM's own modules only when asked for

        return VLLMEngine(model, store, **options)
    raise ValueError(f"unknown engine {kind!r}; available: {', '.join(ENGINE_KINDS)}")


__all__ = [
    "ENGINE_KINDS",
    "BatchScheduler",
    "ChunkRef",
    "DecodeRow",
    "EdgeTimings",
    "Engine",
    "EngineClosedError",
    "EngineProtocol",
    "FusionDiagnostics",
    "FusionStats",
    "GenerationRequest",
    "GenerationResult",
    "JsonConstraint",
    "PromptBuilder",
    "PromptPart",
    "RequestHandle",
    "SamplingParams",
    "SchedulerClosedError",
    "SchedulerStats",
    "StreamHandle",
    "TokenEvent",
    "TokenStream",
    "create_engine",
]
