"""LangChain integration end to end: real chains over a real ingested store and the real engine."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import time
from typing import Any

import pytest
from langchain_cacheblend import (
    MESSAGE_CHUNK_IDS_KEY,
    CacheBlendLLM,
    CacheBlendRetriever,
    ChatCacheBlend,
    create_cacheblend_rag_chain,
    format_documents,
)
from langchain_core.callbacks import BaseCallbackHandler, get_usage_metadata_callback
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnablePassthrough
from pydantic import ValidationError

from cacheblend_rag.engine import SamplingParams
from cacheblend_rag.frontend import get_frontend
from cacheblend_rag.settings import get_settings

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Answer from the context. Be brief."),
        ("human", "Context:\n{context}\n\nQuestion: {question}"),
    ]
)


@pytest.fixture(scope="module")
def retriever(corpus_dir) -> CacheBlendRetriever:
    return CacheBlendRetriever(corpus_dir=corpus_dir, k=2)


def drop_in_chain(retriever, llm):
    """The standard LangChain RAG chain, nothing CacheBlend-specific but the model."""
    return {"context": retriever | format_documents, "question": RunnablePassthrough()} | PROMPT | llm


class MessageRecorder(BaseCallbackHandler):
    """The model's whole messages, as any callback sees them at the end of each call."""

    def __init__(self) -> None:
        self.messages: list[Any] = []

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        self.messages.append(response.generations[0][0].message)


class TokenRecorder(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


def cache_read(message) -> int:
    return message.usage_metadata["input_token_details"]["cache_read"]


def cache_creation(message) -> int:
    return message.usage_metadata["input_token_details"]["cache_creation"]


def test_retriever_returns_stored_chunks_verbatim(retriever, corpus_dir, question):
    docs = retriever.invoke(question)
    assert len(docs) == 2
    stored = get_frontend(corpus_dir, config=get_settings()).corpus.get_chunks([d.id for d in docs])
    for doc, chunk in zip(docs, stored, strict=True):
        assert doc.id == doc.metadata["chunk_id"] == chunk.chunk_id
        assert doc.page_content == chunk.text
        assert doc.metadata["score"] > 0


def test_drop_in_chain_reuses_chunk_kv_and_streams_the_same_answer(retriever, corpus_dir, question):
    chain = drop_in_chain(retriever, ChatCacheBlend(corpus_dir=corpus_dir, max_tokens=MAX_TOKENS))
    message = chain.invoke(question)
    meta, usage = message.response_metadata, message.usage_metadata
    chunk_ids = [d.id for d in retriever.invoke(question)]
    assert meta["chunk_ids"] == chunk_ids  # both retrieved chunks recognised in the prompt
    # read from a cache, never chunk KV computed for this request (the first answer computes it)
    assert cache_read(message) == meta["cached_tokens"] <= meta["reused_tokens"]
    assert meta["reused_tokens"] > 0 and cache_read(message) + cache_creation(message) > 0
    chunk_tokens = sum(
        len(c.token_ids) for c in get_frontend(corpus_dir, config=get_settings()).corpus.get_chunks(chunk_ids)
    )
    assert usage["input_tokens"] > chunk_tokens > cache_read(message)
    assert meta["method"] == "cacheblend" and 0 < meta["recompute_ratio"] < 0.5
    assert meta["ttft_s"] > 0 and usage["output_tokens"] > 0 and message.content

    recorder = TokenRecorder()
    chunks = list(chain.stream(question, config={"callbacks": [recorder]}))
    text_chunks = [c.content for c in chunks if c.content]
    assert len(text_chunks) >= 3
    assert recorder.tokens == [c.content for c in chunks]  # token by token through the callback manager
    assert "".join(text_chunks) == message.content  # greedy: streaming gives the invoke answer
    # the same blend, its chunk KV now read from the store (whatever the invoke had to compute)
    streamed = sum(chunks[1:], chunks[0])
    assert cache_read(streamed) == meta["reused_tokens"] and cache_creation(streamed) == 0


def test_cacheblend_at_ratio_one_equals_full_prefill(retriever, corpus_dir, question):
    blend = drop_in_chain(retriever, ChatCacheBlend(corpus_dir=corpus_dir, ratio=1.0, max_tokens=MAX_TOKENS))
    full = drop_in_chain(
        retriever, ChatCacheBlend(corpus_dir=corpus_dir, method="full_recompute", max_tokens=MAX_TOKENS)
    )
    blended, reference = blend.invoke(question), full.invoke(question)
    assert blended.response_metadata["recompute_ratio"] == 1.0
    assert cache_read(reference) == 0 and reference.response_metadata["method"] == "full_recompute"
    assert blended.usage_metadata["input_tokens"] == reference.usage_metadata["input_tokens"]
    assert blended.content == reference.content


def test_explicit_chain_answers_as_the_core_api(retriever, corpus_dir, question):
    llm = ChatCacheBlend(corpus_dir=corpus_dir, max_tokens=MAX_TOKENS)
    recorder = MessageRecorder()
    with get_usage_metadata_callback() as usage:
        out = create_cacheblend_rag_chain(retriever, llm).invoke(question, {"callbacks": [recorder]})
    ids = [d.id for d in out["context"]]
    # the answer is a string, as LangChain's own retrieval chains return it
    assert isinstance(out["answer"], str) and out["answer"]
    # the usage is reachable the way LangChain offers it for any chat model; the message, by callback
    (totals,) = usage.usage_metadata.values()
    (answer,) = recorder.messages
    assert totals["input_token_details"]["cache_read"] == cache_read(answer) > 0
    assert totals["output_tokens"] == answer.usage_metadata["output_tokens"]
    assert answer.content == out["answer"] and answer.response_metadata["chunk_ids"] == ids
    # The default prompt is the engine's: same token ids, same segments, same answer as the core API.
    core = get_frontend(corpus_dir, config=get_settings()).rag.query(
        question, chunk_ids=ids, sampling=SamplingParams(MAX_TOKENS)
    )
    assert answer.content.strip() == core.answer
    # the chain's call came first: what it kept was read from a cache or computed for it (then stored),
    # which the core call, after it, reads
    assert (cache_read(answer) + cache_creation(answer), answer.usage_metadata["input_tokens"]) == (
        core.reused_tokens,
        core.prompt_tokens,
    )
    assert core.cached_tokens == core.reused_tokens


class FixedRetriever(BaseRetriever):
    """Another retriever: returns documents the store has never seen."""

    documents: list[Document]

    def _get_relevant_documents(self, query: str, **kwargs: Any) -> list[Document]:
        return self.documents


FOREIGN = [
    "The lighthouse of Varnholm was kept for ninety years by the Osterberg family. Its last keeper, Ingrid "
    "Osterberg, wrote a memoir called The Lamp Room about the storms of the 1950s.",
    "Varnholm is a small island in the northern archipelago. Its ferry runs twice a week in winter and "
    "daily in summer; the island's only school closed in 1987.",
]


def test_documents_from_another_retriever_are_cached_on_first_sight(sample_store, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(sample_store, store)
    other = FixedRetriever(documents=[Document(page_content=t) for t in FOREIGN])
    llm = ChatCacheBlend(corpus_dir=str(store), max_tokens=6)
    recorder = MessageRecorder()
    create_cacheblend_rag_chain(other, llm).invoke("Who wrote The Lamp Room?", {"callbacks": [recorder]})
    (first,) = recorder.messages
    # computed on first sight (cache_creation, not cache_read), then blended like any chunk
    assert first.response_metadata["cache_read_blended_tokens"] == 0 and cache_creation(first) > 0
    frontend = get_frontend(store, config=get_settings())
    added = [frontend.corpus.find_by_text(t) for t in FOREIGN]
    assert all(added) and first.response_metadata["chunk_ids"] == [c.chunk_id for c in added]
    assert all(frontend.engine.store.contains(frontend.engine.chunk_key(c.token_ids)) for c in added)

    # A later question through a plain drop-in chain over the same retriever finds them by their text.
    second = drop_in_chain(other, llm).invoke("When did the school close?")
    assert second.response_metadata["chunk_ids"] == [c.chunk_id for c in added]
    # the chunks are read now (only this other template's opening is computed: an exact head)
    assert second.response_metadata["cache_read_blended_tokens"] > 0


def test_documents_named_in_a_message_are_reused_without_recognition(retriever, corpus_dir, question):
    (doc,) = retriever.invoke(question, k=1)
    text = f"Context:\n{doc.page_content}\n\nQuestion: {question}"
    llm = ChatCacheBlend(corpus_dir=corpus_dir, max_tokens=4, recognise_chunks=False)
    named = llm.invoke([HumanMessage(text, additional_kwargs={MESSAGE_CHUNK_IDS_KEY: [doc.id]})])
    plain = llm.invoke([HumanMessage(text)])
    assert named.response_metadata["chunk_ids"] == [doc.id] and cache_read(named) > 0
    assert plain.response_metadata["chunk_ids"] == [] and cache_read(plain) == 0


async def test_async_calls_leave_the_event_loop_free(retriever, corpus_dir, question):
    chain = drop_in_chain(retriever, ChatCacheBlend(corpus_dir=corpus_dir, max_tokens=MAX_TOKENS))
    ticks: list[float] = []

    async def ticker() -> None:
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    try:
        started = time.perf_counter()
        message = await chain.ainvoke(question)
        chunks = [chunk async for chunk in chain.astream(question)]
        elapsed = time.perf_counter() - started
    finally:
        task.cancel()
    assert cache_read(message) > 0
    assert "".join(c.content for c in chunks) == message.content and len(chunks) >= 3
    # A call that blocked the loop would stall the ticker for about half the time (two similar calls).
    longest_stall = max(b - a for a, b in itertools.pairwise(ticks))
    assert longest_stall < elapsed / 4, f"the event loop stalled {longest_stall:.1f} s of {elapsed:.1f} s"


def test_llm_batches_streams_and_stops(corpus_dir):
    llm = CacheBlendLLM(corpus_dir=corpus_dir, max_tokens=10)
    prompts = ["Name a colour.", "Name a fruit."]
    stats = get_frontend(corpus_dir, config=get_settings()).scheduler.stats
    steps, rows = stats.decode_steps, stats.decode_rows
    answers = llm.batch(prompts)
    assert len(answers) == 2 and all(answers)
    assert stats.decode_rows - rows > stats.decode_steps - steps  # decoded together: one engine batch
    assert answers == [llm.invoke(p) for p in prompts]
    streamed = list(llm.stream(prompts[0]))
    assert len([s for s in streamed if s]) >= 3 and "".join(streamed) == answers[0]
    cut = answers[0].split()[1]  # stop at the second word: the answer ends before it
    stopped = llm.invoke(prompts[0], stop=[cut])
    assert stopped == answers[0][: answers[0].index(cut)]


def test_llm_recognises_chunks_in_a_string_prompt(retriever, corpus_dir, question):
    prompt = PromptTemplate.from_template("Context:\n{context}\n\nQuestion: {question}\nAnswer:")
    text = prompt.format(context=format_documents(retriever.invoke(question)), question=question)
    result = CacheBlendLLM(corpus_dir=corpus_dir, max_tokens=4).generate([text])
    info = result.generations[0][0].generation_info
    assert info["usage_metadata"]["input_token_details"]["cache_read"] > 0
    assert info["chunk_ids"] == [d.id for d in retriever.invoke(question)]
    assert result.llm_output["token_usage"]["cache_read"] == info["cached_tokens"]


def test_bad_input_is_refused_clearly(corpus_dir):
    with pytest.raises(ValidationError, match="unknown method 'fastest'"):
        ChatCacheBlend(corpus_dir=corpus_dir, method="fastest")
    llm = ChatCacheBlend(corpus_dir=corpus_dir, max_tokens=2)
    with pytest.raises(TypeError, match="unsupported option"):
        llm.invoke("hi", max_token=3)
    with pytest.raises(ValueError, match="text only"):
        llm.invoke([HumanMessage([{"type": "image_url", "image_url": {"url": "data:,"}}])])
    with pytest.raises(TypeError, match="needs a ChatCacheBlend or CacheBlendLLM"):
        create_cacheblend_rag_chain(CacheBlendRetriever(corpus_dir=corpus_dir), object())
    for former in (ChatCacheBlend, CacheBlendLLM, CacheBlendRetriever):  # a renamed field is refused
        with pytest.raises(ValidationError, match="store_dir= was renamed corpus_dir="):
            former(store_dir=corpus_dir)


def test_every_holder_over_a_corpus_shows_the_same_session(corpus_dir):
    """The chat model, the LLM and the vector store over one corpus hold one checked corpus + engine."""
    from langchain_cacheblend import CacheBlendVectorStore

    chat = ChatCacheBlend(corpus_dir=corpus_dir, max_tokens=2)
    llm = CacheBlendLLM(corpus_dir=corpus_dir, max_tokens=2)
    store = CacheBlendVectorStore(corpus_dir)
    try:
        session = chat.session
        assert session is not None and session is llm.session is store.session
        assert session.engine is chat.frontend.engine and session.corpus is chat.frontend.corpus
        assert session.corpus is store.collection.corpus
        with pytest.raises((AttributeError, ValueError)):
            chat.session = None  # read-only: the frontend's
        assert chat.session is session
    finally:
        for holder in (chat, llm, store):
            holder.close()
