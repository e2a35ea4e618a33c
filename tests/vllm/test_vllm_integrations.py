"""``engine="vllm"`` from every entry point, each answer held to the PyTorch engine's on the same prompt.

Over one corpus (a copy of the ingested sample corpus): a stock LangChain chain (retriever | format_documents
| prompt | ChatCacheBlend), a LlamaIndex query engine, ``CacheBlendRAG`` (query and query_batch) and the
``query --engine vllm`` command. Each runs once with ``engine="vllm"`` and once with ``engine="torch"``;
greedy answers must be equal token for token (measured: vLLM's CPU fp32 kernels and our fp32 runtime give
the same greedy tokens on these prompts, so no shorter prefix is needed) and the vLLM answers must report
reused chunk KV. One vLLM engine serves the in-process tests (the frontend's, shared by every object over
the corpus); the command starts its own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from typing import Any

import pytest

from cacheblend_rag.engine import SamplingParams
from cacheblend_rag.frontend import get_frontend
from cacheblend_rag.settings import get_settings

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed here; `make test` runs tests/vllm in .venv-vllm")
pytest.importorskip("langchain_core", reason="the LangChain integration needs langchain-core")
pytest.importorskip("llama_index.core", reason="the LlamaIndex integration needs llama-index-core")

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory, sample_store) -> str:
    copy = tmp_path_factory.mktemp("vllm-integrations") / "corpus"
    shutil.copytree(sample_store, copy, ignore=shutil.ignore_patterns("*-shm", "*.lock"))
    return str(copy)


@pytest.fixture(scope="module")
def questions(sample_questions) -> list[str]:
    return [q["question"] for q in sample_questions[:2]]


def reused(message) -> int:
    """Chunk KV kept: read from a cache, or computed for this request by the first to use it."""
    details = message.usage_metadata["input_token_details"]
    return details["cache_read"] + details["cache_creation"]


def test_langchain_chain_on_vllm_answers_as_pytorch(corpus_dir, questions):
    from langchain_cacheblend import CacheBlendRetriever, ChatCacheBlend, format_documents
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "Answer from the context. Be brief."),
            ("human", "Context:\n{context}\n\nQuestion: {question}"),
        ]
    )
    retriever = CacheBlendRetriever(corpus_dir=corpus_dir, k=2)

    def chain(engine: str):
        llm = ChatCacheBlend(corpus_dir=corpus_dir, engine=engine, max_tokens=MAX_TOKENS)
        return {"context": retriever | format_documents, "question": RunnablePassthrough()} | prompt | llm

    on_vllm, on_torch = chain("vllm"), chain("torch")
    got, expected = on_vllm.invoke(questions[0]), on_torch.invoke(questions[0])
    meta = got.response_metadata
    assert meta["claimed_tokens"] > 0  # vLLM served it, the connector provided the blended span
    assert "claimed_tokens" not in expected.response_metadata
    retrieved = [d.id for d in retriever.invoke(questions[0])]
    assert meta["chunk_ids"] == expected.response_metadata["chunk_ids"] == retrieved
    assert got.usage_metadata["input_tokens"] == expected.usage_metadata["input_tokens"]
    assert reused(got) > 0 and reused(expected) > 0
    assert got.usage_metadata["output_tokens"] == expected.usage_metadata["output_tokens"]
    assert got.content == expected.content

    # streaming and a batch (concurrent calls, which vLLM batches) give the same answers
    assert "".join(c.content for c in on_vllm.stream(questions[0])) == got.content
    batch = on_vllm.batch(questions)
    assert [m.content for m in batch] == [got.content, on_torch.invoke(questions[1]).content]
    assert all(reused(m) > 0 for m in batch)


class _Reports:
    """The engine reports (``response.raw``) of LlamaIndex LLM calls, through its instrumentation."""

    def __enter__(self) -> list[dict[str, Any]]:
        from llama_index.core.instrumentation import get_dispatcher
        from llama_index.core.instrumentation.event_handlers import BaseEventHandler
        from llama_index.core.instrumentation.events.llm import LLMChatEndEvent

        reports: list[dict[str, Any]] = []

        class Handler(BaseEventHandler):
            @classmethod
            def class_name(cls) -> str:
                return "Reports"

            def handle(self, event: Any, **kwargs: Any) -> None:
                if isinstance(event, LLMChatEndEvent) and event.response is not None:
                    reports.append(event.response.raw)

        self._dispatcher, self._handler = get_dispatcher(), Handler()
        self._dispatcher.add_event_handler(self._handler)
        return reports

    def __exit__(self, *exc: object) -> None:
        self._dispatcher.event_handlers.remove(self._handler)


def test_llamaindex_query_engine_on_vllm_answers_as_pytorch(corpus_dir, questions):
    from llama_index.llms.cacheblend import CacheBlendLLM
    from llama_index.retrievers.cacheblend import CacheBlendQueryEngine

    answers = {}
    for engine in ("vllm", "torch"):
        llm = CacheBlendLLM(corpus_dir=corpus_dir, engine=engine, max_tokens=MAX_TOKENS)
        query_engine = CacheBlendQueryEngine.from_corpus(corpus_dir, llm=llm, similarity_top_k=2)
        with _Reports() as reports:
            response = query_engine.query(questions[1])
        (report,) = reports
        answers[engine] = (str(response), report)
        assert report["chunk_ids"] == [n.node.node_id for n in response.source_nodes]
        assert report["reused_tokens"] > 0
        assert llm.metadata.context_window > 0
    (got, vllm_report), (expected, torch_report) = answers["vllm"], answers["torch"]
    assert 0 < vllm_report["claimed_tokens"] <= vllm_report["vllm_cached_tokens"]
    assert vllm_report["prompt_tokens"] == torch_report["prompt_tokens"]
    assert got == expected


def test_cacheblend_rag_on_vllm_answers_as_pytorch(corpus_dir, questions):
    """The frontend's ``CacheBlendRAG`` is the one built with ``engine="vllm"``: query and query_batch."""
    from cacheblend_rag.engine.vllm import VLLMEngine
    from cacheblend_rag.rag import CacheBlendRAG

    rag, reference = (
        get_frontend(corpus_dir, engine_kind="vllm", config=get_settings()).rag,
        get_frontend(corpus_dir, engine_kind="torch", config=get_settings()).rag,
    )
    assert isinstance(rag, CacheBlendRAG) and isinstance(rag.engine, VLLMEngine)
    sampling = SamplingParams(MAX_TOKENS)
    got = rag.query(questions[0], sampling=sampling)
    expected = reference.query(questions[0], sampling=sampling)
    assert got.chunk_ids == expected.chunk_ids and got.prompt_tokens == expected.prompt_tokens
    assert got.reused_tokens > 0 and got.answer == expected.answer
    batch = rag.query_batch(questions, sampling=sampling)
    second = reference.query(questions[1], sampling=sampling)
    assert [r.answer for r in batch] == [expected.answer, second.answer]
    with pytest.raises(ValueError, match="disagree"):
        CacheBlendRAG(corpus_dir, engine="vllm", engine_kind="torch")


def test_query_command_on_vllm_answers_as_pytorch(corpus_dir, questions):
    sampling = SamplingParams(MAX_TOKENS)
    reference = get_frontend(corpus_dir, engine_kind="torch", config=get_settings()).rag.query(
        questions[0], sampling=sampling
    )
    command = [sys.executable, "-m", "cacheblend_rag", "query", questions[0], "--corpus", corpus_dir]
    options = ["--engine", "vllm", "--max-tokens", str(MAX_TOKENS), "--json"]
    done = subprocess.run([*command, *options], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("{"), f"stdout holds more than the JSON answer: {done.stdout[:1000]!r}"
    result = json.loads(done.stdout)
    assert result["chunk_ids"] == reference.chunk_ids
    assert result["reused_tokens"] > 0 and result["answer"] == reference.answer
