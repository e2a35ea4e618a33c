"""llama-index-llms-cacheblend's public API, as LlamaHub imports it (no model is loaded)."""

from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.llms import CustomLLM


def test_public_api():
    from llama_index.llms.cacheblend import CacheBlendLLM, CacheBlendSynthesizer, CacheBlendUsageHandler

    assert issubclass(CacheBlendLLM, CustomLLM) and issubclass(CacheBlendUsageHandler, BaseEventHandler)
    assert CacheBlendLLM.class_name() and CacheBlendSynthesizer.__name__ == "CacheBlendSynthesizer"
    assert CacheBlendUsageHandler().totals()["cached_tokens"] == 0
