"""LlamaIndex integration end to end: real query engines over a real ingested store and the real engine;
structured prediction under the output class's JSON schema."""

from __future__ import annotations

import json

import pytest
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole
from llama_index.core.prompts import PromptTemplate
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers import SimpleSummarize
from llama_index.core.schema import QueryBundle
from llama_index.llms.cacheblend import CacheBlendLLM, CacheBlendSynthesizer
from llama_index.retrievers.cacheblend import CacheBlendQueryEngine, CacheBlendRetriever
from pydantic import BaseModel, Field

from cacheblend_rag.frontend import get_frontend
from cacheblend_rag.settings import get_settings

pytestmark = pytest.mark.slow

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llm(corpus_dir) -> CacheBlendLLM:
    return CacheBlendLLM(corpus_dir=corpus_dir, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def retriever(corpus_dir) -> CacheBlendRetriever:
    return CacheBlendRetriever(corpus_dir, similarity_top_k=2)


def test_retriever_nodes_are_stored_chunks(retriever, corpus_dir, question):
    nodes = retriever.retrieve(question)
    assert len(nodes) == 2
    stored = get_frontend(corpus_dir, config=get_settings()).corpus.get_chunks(
        [n.node.node_id for n in nodes]
    )
    for node, chunk in zip(nodes, stored, strict=True):
        assert node.node.node_id == node.node.metadata["chunk_id"] == chunk.chunk_id
        # what any synthesizer pastes for the LLM is the stored text, metadata hidden
        assert node.node.get_content(metadata_mode="llm") == chunk.text
        assert node.score > 0


def test_query_engine_hands_nodes_to_the_llm_as_segments(llm, corpus_dir, question, llm_reports):
    engine = CacheBlendQueryEngine.from_corpus(corpus_dir, llm=llm, similarity_top_k=2)
    response = engine.query(question)
    (report,) = llm_reports
    node_ids = [n.node.node_id for n in response.source_nodes]
    assert report["chunk_ids"] == node_ids
    assert report["reused_tokens"] > 0 and report["method"] == "cacheblend"
    assert str(response).strip()

    streaming = CacheBlendQueryEngine.from_corpus(corpus_dir, llm=llm, similarity_top_k=2, streaming=True)
    tokens = list(streaming.query(question).response_gen)
    assert len([t for t in tokens if t]) >= 3
    assert "".join(tokens) == str(response)  # greedy: the same answer, token by token


def test_stock_query_engine_benefits_by_recognition(llm, retriever, question, llm_reports):
    """Stock SimpleSummarize pastes str(list_of_texts) (llama-index-core 0.14): the chunks appear escaped.
    Their escaped form is recognised, its KV computed on first sight and reused from then on."""
    engine = RetrieverQueryEngine(retriever, response_synthesizer=SimpleSummarize(llm=llm))
    first = engine.query(question)
    second = engine.query(question)
    node_ids = [n.node.node_id for n in first.source_nodes]
    assert [r["chunk_ids"] for r in llm_reports] == [node_ids, node_ids]
    assert llm_reports[0]["reused_tokens"] > 0 and llm_reports[1]["reused_tokens"] > 0
    assert str(first) == str(second)


async def test_async_query_and_streaming(llm, corpus_dir, question, llm_reports):
    engine = CacheBlendQueryEngine.from_corpus(corpus_dir, llm=llm, similarity_top_k=2)
    response = await engine.aquery(question)
    assert llm_reports[0]["reused_tokens"] > 0 and str(response).strip()

    nodes = await CacheBlendRetriever(corpus_dir, 2).aretrieve(QueryBundle(question))
    message = ChatMessage(role=MessageRole.USER, content=f"{nodes[0].node.get_content()}\n\n{question}")
    stream = await llm.astream_chat([message], documents=nodes[:1])
    deltas = [r.delta async for r in stream]
    assert len([d for d in deltas if d]) >= 3
    assert llm_reports[-1]["reused_tokens"] > 0 and "".join(deltas) == llm_reports[-1]["text"]
    assert llm_reports[-1]["chunk_ids"] == [nodes[0].node.node_id]


class Author(BaseModel):
    name: str = Field(description="the author's name")
    confident: bool


async def test_structured_predict_decodes_under_the_output_class(
    corpus_dir, retriever, question, llm_reports
):
    """``structured_predict``, ``as_structured_llm``, streamed and async: LlamaIndex's own program writes the
    prompt and parses the answer, and the answer is decoded under the class's JSON schema (the whole text
    is the object's JSON, nothing around it), reusing the KV of the chunks in the prompt."""
    llm = CacheBlendLLM(corpus_dir=corpus_dir, max_tokens=48)
    context = "\n\n".join(n.node.get_content() for n in retriever.retrieve(question))
    prompt = PromptTemplate("Context:\n{context}\n\nQuestion: {question}")
    try:
        got = llm.structured_predict(Author, prompt, context=context, question=question)
        assert isinstance(got, Author) and json.loads(llm_reports[-1]["text"]) == got.model_dump()
        assert llm_reports[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        streamed = list(llm.stream_structured_predict(Author, prompt, context=context, question=question))
        assert streamed[-1].model_dump() == got.model_dump()
        assert await llm.astructured_predict(Author, prompt, context=context, question=question) == got
        message = ChatMessage(role=MessageRole.USER, content=f"Context:\n{context}\n\nQuestion: {question}")
        response = llm.as_structured_llm(Author).chat([message])
        assert (
            isinstance(response.raw, Author)
            and json.loads(response.message.content) == response.raw.model_dump()
        )
    finally:
        llm.close()


def test_the_llm_shows_the_session_it_answers_with(llm, corpus_dir, question):
    session = llm.session
    shared = get_frontend(corpus_dir, config=get_settings())
    assert session is not None and session is shared.session, "one session per corpus and settings"
    assert session.engine is llm.frontend.engine and session.corpus.search(question, 1)
    with pytest.raises((AttributeError, ValueError)):
        llm.session = None  # read-only: the frontend's


def test_complete_and_chat(llm, llm_reports):
    completion = llm.complete("Name a colour.", max_tokens=6)
    streamed = list(llm.stream_complete("Name a colour.", max_tokens=6))
    assert completion.text and streamed[-1].text == completion.text
    assert "".join(r.delta for r in streamed) == completion.text
    assert completion.additional_kwargs["completion_tokens"] >= 1
    chat = llm.chat([ChatMessage(role=MessageRole.USER, content="Name a colour.")], max_tokens=6)
    assert chat.message.content == completion.text  # complete() sends the prompt as one user turn
    assert llm.metadata.is_chat_model and llm.metadata.context_window == 8192


def test_bad_input_is_refused_clearly(llm, corpus_dir):
    with pytest.raises(ValueError, match="text only"):
        llm.chat([ChatMessage(role=MessageRole.USER, blocks=[ImageBlock(url="http://example.com/a.png")])])
    with pytest.raises(TypeError, match="unsupported option"):
        llm.complete("hi", max_token=3)
    with pytest.raises(TypeError, match="needs a CacheBlendLLM"):
        CacheBlendSynthesizer(llm=object())
    with pytest.raises(ValueError, match="similarity_top_k"):
        CacheBlendRetriever(corpus_dir, similarity_top_k=0)
