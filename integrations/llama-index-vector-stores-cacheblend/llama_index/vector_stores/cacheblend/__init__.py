"""LlamaIndex vector store of cacheblend-rag: your nodes in a corpus whose chunk KV is precomputed for
``CacheBlendLLM``."""

from .base import CacheBlendVectorStore, to_filter

__all__ = ["CacheBlendVectorStore", "to_filter"]
