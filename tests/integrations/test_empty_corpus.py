"""LLMs over an empty or missing folder: the folder becomes a corpus, as for the vector
stores (README), in both frameworks; documents passed with a call are then remembered in it."""

from __future__ import annotations

import pytest
from langchain_cacheblend import ChatCacheBlend
from langchain_core.documents import Document
from llama_index.llms.cacheblend import CacheBlendLLM

from cacheblend_rag.corpus.manifest import CorpusManifest

pytestmark = pytest.mark.slow

PASSAGE = "The lighthouse on Gull Rock was built in 1871 and painted red in 1902."


@pytest.mark.parametrize("state", ["missing", "empty"])
def test_chat_model_over_an_empty_or_missing_folder_answers_and_remembers(tmp_path, state):
    folder = tmp_path / "corpus"
    if state == "empty":
        folder.mkdir()
    llm = ChatCacheBlend(corpus_dir=folder, max_tokens=4)
    try:
        prompt = f"Context:\n{PASSAGE}\n\nQuestion: When was the lighthouse built?"
        message = llm.invoke(prompt, documents=[Document(page_content=PASSAGE)])
        assert message.content
        assert CorpusManifest.load(folder) is not None  # a corpus now
        assert len(message.response_metadata["chunk_ids"]) == 1  # the passed document, remembered
        assert message.response_metadata["kv_computed_tokens"] > 0  # its KV computed on first sight
    finally:
        llm.close()


def test_llamaindex_llm_over_a_missing_folder_answers(tmp_path):
    folder = tmp_path / "missing"
    llm = CacheBlendLLM(corpus_dir=folder, max_tokens=4)
    try:
        assert llm.complete("Say hello.").text
        assert CorpusManifest.load(folder) is not None
    finally:
        llm.close()
