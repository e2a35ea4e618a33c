"""The time to first token counts from the call: where a retrieved chunk has no stored KV, the KV computed
for the request is inside ``ttft_s`` (reported apart as ``prompt_s``) for the Python API, ``query --json``
and LangChain alike; with the KV stored, nothing is computed and ``prompt_s`` is a read. Real engine over
a copy of the sample store, ingested without KV."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from langchain_cacheblend import ChatCacheBlend
from langchain_core.documents import Document

from cacheblend_rag.engine.engine import Engine
from cacheblend_rag.rag import CacheBlendRAG

pytestmark = pytest.mark.slow

QUESTION = "Where was the author of Hannibal and Scipio educated at?"


@pytest.fixture
def timed_precompute(monkeypatch):
    """Seconds spent computing chunk KV (the engine's own precompute, timed around every call)."""
    spent: list[float] = []
    precompute = Engine.precompute

    def timed(self, token_ids, context=None):
        started = time.perf_counter()
        try:
            return precompute(self, token_ids, context)
        finally:
            spent.append(time.perf_counter() - started)

    monkeypatch.setattr(Engine, "precompute", timed)
    return spent


def test_python_api_counts_the_kv_computed_for_the_call(rag_store, timed_precompute):
    rag = CacheBlendRAG(rag_store)
    try:
        called = time.perf_counter()
        handle = rag.stream(QUESTION, top_k=3, max_tokens=2)
        first = next(iter(handle))
        first_at = time.perf_counter() - called
        result = handle.result()
        assert first.text and result.kv_computed_tokens > 0 and timed_precompute
        computing = sum(timed_precompute)
        assert result.ttft_s >= computing and result.prompt_s >= computing
        assert result.ttft_s >= result.retrieval_s + result.prompt_s + result.queue_s + result.fusion_s
        assert result.ttft_s <= first_at  # counted from the call, not before it
        assert result.total_s >= result.ttft_s
        # the KV is stored now: the same question computes none, and its prompt is a read
        timed_precompute.clear()
        again = rag.query(QUESTION, top_k=3, max_tokens=2)
        assert again.kv_computed_tokens == 0 and not timed_precompute
        assert again.prompt_s < result.prompt_s and again.ttft_s < result.ttft_s
    finally:
        rag.close()


def test_query_json_and_langchain_count_from_the_call(rag_store, timed_precompute):
    argv = ["query", "--corpus", str(rag_store), "--json", "--max-tokens", "2", "--top-k", "3", QUESTION]
    done = subprocess.run(
        [sys.executable, "-m", "cacheblend_rag", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "CACHEBLEND_THREADS": "1"},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reported = json.loads(done.stdout)
    assert reported["kv_computed_tokens"] > 0 and reported["prompt_s"] > 0
    assert reported["ttft_s"] >= reported["retrieval_s"] + reported["prompt_s"] + reported["fusion_s"]
    chat = ChatCacheBlend(corpus_dir=str(rag_store), max_tokens=2)
    # a chunk the CLI did not compute: passed as a document, its KV computed for this call
    text = "Tim Dubois was born in Grady County, Oklahoma, and grew up on a farm there."
    prompt = f"Context:\n{text}\n\nQuestion: Where was Tim Dubois born?"
    message = chat.invoke(prompt, documents=[Document(page_content=text)])
    meta = message.response_metadata
    assert meta["kv_computed_tokens"] > 0 and timed_precompute
    assert meta["ttft_s"] >= meta["prompt_s"] >= sum(timed_precompute)
