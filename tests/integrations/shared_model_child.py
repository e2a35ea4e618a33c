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
    assert chat.invoke("Name a colour.").content is not None
    assert llm.complete("Name a colour.").text is not None
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
    assert twin.invoke("Name a fruit.").content is not None and len(shared_models()) == 1
    twin.close()
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
