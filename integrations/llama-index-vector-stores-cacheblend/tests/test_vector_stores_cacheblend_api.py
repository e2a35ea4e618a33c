"""llama-index-vector-stores-cacheblend's public API, as LlamaHub imports it (no model is loaded)."""

from llama_index.core.vector_stores.types import BasePydanticVectorStore


def test_public_api():
    from llama_index.vector_stores.cacheblend import CacheBlendVectorStore, to_filter

    assert issubclass(CacheBlendVectorStore, BasePydanticVectorStore) and callable(to_filter)
    assert CacheBlendVectorStore.model_fields["stores_text"].default is True
