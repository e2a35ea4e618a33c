"""What the LLM objects of both frameworks do around their answers: one warning when nothing is reused
(and how to fix it), corpus folders as str or Path, one shared model per process freed on close()."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from langchain_cacheblend import CacheBlendLLM as LangChainLLM
from langchain_cacheblend import CacheBlendRetriever, ChatCacheBlend
from llama_index.llms.cacheblend import CacheBlendLLM as LlamaIndexLLM
from llama_index.retrievers.cacheblend import CacheBlendRetriever as LlamaIndexRetriever

pytestmark = pytest.mark.slow

LOGGER = "cacheblend_rag.frontend.options"
FIXES = ("CacheBlendVectorStore", "create_cacheblend_rag_chain", "documents=")


def no_reuse_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and "no chunk KV is reused" in r.getMessage()]


@pytest.mark.parametrize(
    "make, ask",
    [
        (lambda d: ChatCacheBlend(corpus_dir=d, max_tokens=2), lambda m, p: m.invoke(p)),
        (lambda d: LangChainLLM(corpus_dir=d, max_tokens=2), lambda m, p: m.invoke(p)),
        (lambda d: LlamaIndexLLM(corpus_dir=d, max_tokens=2), lambda m, p: m.complete(p)),
    ],
    ids=["langchain-chat", "langchain-llm", "llamaindex-llm"],
)
def test_no_reuse_is_said_once_per_object_with_the_fix(make, ask, corpus_dir, question, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    model = make(corpus_dir)
    ask(model, "Name a colour.")
    ask(model, "Name a fruit.")
    (warning,) = no_reuse_warnings(caplog)
    assert all(fix in warning.getMessage() for fix in FIXES) and corpus_dir in warning.getMessage()
    ask(make(corpus_dir), "Name a colour.")  # another object says it too
    assert len(no_reuse_warnings(caplog)) == 2

    (doc,) = CacheBlendRetriever(corpus_dir=corpus_dir, k=1).invoke(question)
    fresh = make(corpus_dir)
    ask(fresh, f"Context:\n{doc.page_content}\n\nQuestion: {question}")  # a stored chunk: reused, no warning
    assert len(no_reuse_warnings(caplog)) == 2


def test_corpus_folders_are_taken_as_str_or_path(corpus_dir, question):
    folder = Path(corpus_dir)
    chat = ChatCacheBlend(corpus_dir=folder, max_tokens=2)
    assert chat.corpus_dir == corpus_dir and LangChainLLM(corpus_dir=folder).corpus_dir == corpus_dir
    assert LlamaIndexLLM(corpus_dir=folder).corpus_dir == corpus_dir
    docs = CacheBlendRetriever(corpus_dir=folder, k=1).invoke(question)
    nodes = LlamaIndexRetriever(folder, similarity_top_k=1).retrieve(question)
    assert docs[0].id == nodes[0].node.node_id
    message = chat.invoke(f"Context:\n{docs[0].page_content}\n\nQuestion: {question}")
    assert message.usage_metadata["input_token_details"]["cache_read"] > 0


def test_llm_objects_share_one_model_and_close_frees_it(sample_store, tmp_path):
    """In a fresh process (other tests here hold the model): two LLM objects over two corpora, one model."""
    folders = []
    for name in ("a", "b"):
        shutil.copytree(sample_store, tmp_path / name)
        folders.append(str(tmp_path / name))
    child = Path(__file__).with_name("shared_model_child.py")
    env = {**os.environ, "CACHEBLEND_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(child), *folders], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]
