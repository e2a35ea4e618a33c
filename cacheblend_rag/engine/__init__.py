"""Prefill, fusion, decoding and streaming over one model and one KV store."""

from pathlib import Path

from ..settings import get_settings
from ..store.kvstore import KVStore
from .engine import Engine, GenerationResult, TokenEvent
from .prompt import ChunkRef, PromptBuilder
from .sampling import SamplingParams

ENGINE_KINDS = ("torch", "vllm")


def create_engine(
    kind: str | None = None,
    model: str | Path | None = None,
    store: KVStore | str | Path | None = None,
    **options,
):
    """The engine ``kind`` names over ``model`` and ``store``: ``"torch"`` (:class:`Engine`, our PyTorch
    runtime) or ``"vllm"`` (:class:`~cacheblend_rag.engine.vllm.VLLMEngine`, vLLM with the CacheBlend KV
    connector). Default: the ``engine`` setting. ``options`` go to the engine's constructor."""
    kind = kind or get_settings().engine
    if kind == "torch":
        return Engine(model, store, **options)
    if kind == "vllm":
        from .vllm import VLLMEngine

        return VLLMEngine(model, store, **options)
    raise ValueError(f"unknown engine {kind!r}; available: {', '.join(ENGINE_KINDS)}")


__all__ = [
    "ENGINE_KINDS",
    "ChunkRef",
    "Engine",
    "GenerationResult",
    "PromptBuilder",
    "SamplingParams",
    "TokenEvent",
    "create_engine",
]
