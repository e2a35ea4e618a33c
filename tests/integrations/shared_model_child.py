"""Run in a process of its own by test_llm_lifecycle.py: two LLM objects of two frameworks over two
corpora share one loaded model, and closing both frees it. Prints OK on success."""

from __future__ import annotations

import gc
import sys
import weakref

from langchain_cacheblend import ChatCacheBlend
from llama_index.llms.cacheblend import CacheBlendLLM

from cacheblend_rag.models.shared import shared_models


def main(corpus_a: str, corpus_b: str) -> None:
    chat = ChatCacheBlend(corpus_dir=corpus_a, max_tokens=2)
    llm = CacheBlendLLM(corpus_dir=corpus_b, max_tokens=2)
    twin = ChatCacheBlend(corpus_dir=corpus_b, max_tokens=2)
    # each object really answered through its engine: tokens generated, within its max_tokens
    answer = chat.invoke("Name a colour.")
    assert 1 <= answer.usage_metadata["output_tokens"] <= 2, answer.usage_metadata
    completion = llm.complete("Name a colour.")
    assert 1 <= completion.additional_kwargs["completion_tokens"] <= 2, completion.additional_kwargs
    model = chat.frontend.engine.model
    assert chat.frontend is not llm.frontend, "two corpora, two engines"
    assert llm.frontend is twin.frontend, "one corpus, one engine"
    assert llm.frontend.engine.model is model, "one model for both engines"
    assert list(shared_models().values()) == [2], shared_models()  # one load, held by two engines
    freed = weakref.ref(model)
    del model
    chat.close()
    llm.close()
    assert freed() is not None, "twin still holds the engine over corpus_b"
    assert list(shared_models().values()) == [1]
    twin.close()
    gc.collect()
    assert shared_models() == {}, shared_models()
    assert freed() is None, "closing every holder frees the model"
    # a closed object loads it again when used
    again = twin.invoke("Name a fruit.")
    assert again.usage_metadata["output_tokens"] >= 1 and len(shared_models()) == 1
    twin.close()
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
