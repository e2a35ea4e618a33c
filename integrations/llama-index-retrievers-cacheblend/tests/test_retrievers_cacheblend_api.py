"""llama-index-retrievers-cacheblend's public API, as LlamaHub imports it (no model is loaded)."""

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.base_retriever import BaseRetriever


def test_public_api():
    from llama_index.retrievers.cacheblend import CacheBlendQueryEngine, CacheBlendRetriever, chunk_node

    assert issubclass(CacheBlendRetriever, BaseRetriever)
    assert issubclass(CacheBlendQueryEngine, BaseQueryEngine)
    assert callable(chunk_node)
