"""cacheblend-rag: fast RAG by blending precomputed chunk KV caches with selective recompute (CacheBlend).

The public names, importable from here (``from cacheblend_rag import CacheBlendRAG``):

- answering: :class:`CacheBlendRAG` (retrieve, blend, answer over a corpus), built by
  ``cacheblend_rag.ingest.ingest`` (the function shares its name with its package, so it is imported
  from there);
- engines: :class:`Engine` (PyTorch), :func:`create_engine` (``"torch"`` or ``"vllm"``), the contract
  :class:`EngineProtocol`, :class:`GenerationRequest`, :class:`SamplingParams`, :class:`ChunkRef`,
  :class:`GenerationResult`, :class:`BatchScheduler`, :class:`JsonConstraint` (structured output);
- methods: :class:`RecomputeMethod`, :func:`register_method`, :class:`MethodSpec`, :class:`Segment`;
- storage: :class:`Corpus`, :class:`CorpusManifest` (the corpus directory), :class:`ExternalEmbedder`
  (your own embedding model), :class:`KVStore` (its chunk KV store);
- integrations: :class:`PromptFrontend`, :class:`GenerationOptions`, :class:`DocumentCollection` (what the
  vector stores keep documents in);
- :func:`get_settings`, :class:`Settings` (read at the edges), :class:`Config` (the values the core takes:
  ``config=get_settings()`` passes the settings down), :class:`SettingsError` and :class:`CacheBlendError`.

They load on first use: importing the package stays cheap for the command line and vLLM's worker
processes, which import single modules of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .lazy import load_export

_EXPORTS = {
    "CacheBlendRAG": "rag",
    "QueryResult": "rag",
    "IngestSummary": "ingest",
    "Engine": "engine",
    "EngineProtocol": "engine",
    "create_engine": "engine",
    "GenerationRequest": "engine",
    "BatchScheduler": "engine",
    "ChunkRef": "engine",
    "GenerationResult": "engine",
    "JsonConstraint": "engine",
    "SamplingParams": "engine",
    "TokenEvent": "engine",
    "RecomputeMethod": "blend",
    "register_method": "blend",
    "available_methods": "blend",
    "MethodSpec": "blend",
    "Reuse": "blend",
    "Segment": "blend",
    "Corpus": "corpus",
    "CorpusManifest": "corpus",
    "ExternalEmbedder": "corpus",
    "KVStore": "store",
    "PromptFrontend": "frontend",
    "GenerationOptions": "frontend",
    "DocumentCollection": "frontend",
    "get_settings": "settings",
    "Settings": "settings",
    "Config": "config",
    "SettingsError": "settings",
    "CacheBlendError": "errors",
}

__all__ = [
    "BatchScheduler",
    "CacheBlendError",
    "CacheBlendRAG",
    "ChunkRef",
    "Config",
    "Corpus",
    "CorpusManifest",
    "DocumentCollection",
    "Engine",
    "EngineProtocol",
    "ExternalEmbedder",
    "GenerationOptions",
    "GenerationRequest",
    "GenerationResult",
    "IngestSummary",
    "JsonConstraint",
    "KVStore",
    "MethodSpec",
    "PromptFrontend",
    "QueryResult",
    "RecomputeMethod",
    "Reuse",
    "SamplingParams",
    "Segment",
    "Settings",
    "SettingsError",
    "TokenEvent",
    "available_methods",
    "create_engine",
    "get_settings",
    "register_method",
]

if TYPE_CHECKING:
    from .blend import MethodSpec, RecomputeMethod, Reuse, Segment, available_methods, register_method
    from .config import Config
    from .corpus import Corpus, CorpusManifest, ExternalEmbedder
    from .engine import (
        BatchScheduler,
        ChunkRef,
        Engine,
        EngineProtocol,
        GenerationRequest,
        GenerationResult,
        JsonConstraint,
        SamplingParams,
        TokenEvent,
        create_engine,
    )
    from .errors import CacheBlendError
    from .frontend import DocumentCollection, GenerationOptions, PromptFrontend
    from .ingest import IngestSummary
    from .rag import CacheBlendRAG, QueryResult
    from .settings import Settings, SettingsError, get_settings
    from .store import KVStore


def __getattr__(name: str) -> Any:
    return load_export(__name__, _EXPORTS, name, globals())


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
