"""Reuse through LlamaIndex's instrumentation: CacheBlendUsageHandler totals what each
answer read from a cache, recomputed and computed for the request; TokenCountingHandler cannot."""

from __future__ import annotations

import pytest
from llama_index.core.instrumentation import get_dispatcher
from llama_index.llms.cacheblend import CacheBlendLLM, CacheBlendUsageHandler
from llama_index.retrievers.cacheblend import CacheBlendRetriever

pytestmark = pytest.mark.slow


def test_the_usage_handler_shows_reuse_across_calls(corpus_dir, question, llm_reports):
    handler = CacheBlendUsageHandler()
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    llm = CacheBlendLLM(corpus_dir=corpus_dir, max_tokens=4)
    try:
        engine = CacheBlendRetriever(corpus_dir, 2)
        context = "\n\n".join(n.node.get_content() for n in engine.retrieve(question))
        prompt = f"Context:\n{context}\n\nQuestion: {question}"
        llm.complete(prompt)
        llm.complete(prompt)  # the chunks' KV is read now, whatever the first call computed
    finally:
        dispatcher.event_handlers.remove(handler)
        llm.close()
    usages = [r["usage"] for r in llm_reports[-2:]]
    assert handler.calls == 2
    assert handler.cached_tokens == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages) > 0
    assert handler.prompt_tokens == sum(u["prompt_tokens"] for u in usages)
    assert usages[1]["prompt_tokens_details"]["cache_read_blended_tokens"] > 0
    assert handler.kv_computed_tokens == usages[0]["prompt_tokens_details"]["kv_computed_tokens"]
    handler.reset()
    assert handler.totals() == dict.fromkeys(handler.totals(), 0)
