"""LlamaIndex vector store of cacheblend-rag: your nodes in a corpus whose chunk KV is precomputed for
``CacheBlendLLM``, embedded by default with cacheblend-rag's own offline embedder
(:class:`CacheBlendEmbedding`)."""

from .base import CacheBlendVectorStore, to_filter
from .embedding import CacheBlendEmbedding

__all__ = ["CacheBlendEmbedding", "CacheBlendVectorStore", "to_filter"]
