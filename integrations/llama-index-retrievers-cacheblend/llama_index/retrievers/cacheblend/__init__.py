"""LlamaIndex retriever and query engine over a cacheblend-rag store."""

from .base import CacheBlendRetriever, chunk_node
from .query_engine import CacheBlendQueryEngine

__all__ = ["CacheBlendQueryEngine", "CacheBlendRetriever", "chunk_node"]
