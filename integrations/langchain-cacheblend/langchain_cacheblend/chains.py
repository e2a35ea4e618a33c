"""A RAG chain that hands the retrieved documents to the model as segments (no text search needed)."""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter
from typing import Any

from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import BasePromptTemplate, ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableLambda, RunnablePassthrough

from cacheblend_rag.engine.prompt import CHUNK_SEPARATOR, DEFAULT_SYSTEM_PROMPT, DEFAULT_USER_TEMPLATE

from .chat_models import ChatCacheBlend
from .llms import CacheBlendLLM

# The engine's own RAG prompt: with ChatCacheBlend, chain answers equal CacheBlendRAG.query's.
DEFAULT_RAG_PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", DEFAULT_SYSTEM_PROMPT),
        ("human", DEFAULT_USER_TEMPLATE.replace("{passages}", "{context}")),
    ]
)


def format_documents(documents: Sequence[Document]) -> str:
    """Documents' texts joined by blank lines, unchanged (so stored chunks stay recognisable)."""
    return CHUNK_SEPARATOR.join(doc.page_content for doc in documents)


def create_cacheblend_rag_chain(
    retriever: BaseRetriever | Runnable,
    llm: ChatCacheBlend | CacheBlendLLM,
    prompt: BasePromptTemplate | None = None,
) -> Runnable:
    """``question -> {"input", "context", "answer"}``: retrieve, fill ``prompt`` (variables ``context`` and
    ``question``; default :data:`DEFAULT_RAG_PROMPT`) and answer, passing the retrieved documents to ``llm``
    with the prompt so each becomes a cached segment: stored chunks by id, documents from any other
    retriever added to the store and KV-cached on first sight.

    The input is the question, as a string or as ``{"input": question}``. ``answer`` is the answer's
    text, a string, as in LangChain's own retrieval chains (an output parser ends the answer's runnable).
    The model's usage reaches callbacks as any chat model's does: token counts with the reused ones in
    ``input_token_details["cache_read"]`` through
    ``langchain_core.callbacks.get_usage_metadata_callback()``, and the whole message (its
    ``response_metadata``: chunk ids, TTFT, recompute ratio) in a callback's ``on_llm_end``. Streaming
    the chain streams the answer's text token by token.

    Example:
        .. code-block:: python

            from langchain_core.callbacks import get_usage_metadata_callback

            with get_usage_metadata_callback() as usage:
                answer = chain.invoke("Who wrote Emilia Galotti?")["answer"]  # a str
            usage.usage_metadata  # {model name: {"input_tokens", ..., "input_token_details"}}
    """
    if not isinstance(llm, ChatCacheBlend | CacheBlendLLM):
        raise TypeError(
            f"create_cacheblend_rag_chain needs a ChatCacheBlend or CacheBlendLLM, got {type(llm).__name__}; "
            "other models cannot take documents as segments"
        )
    prompt = prompt or DEFAULT_RAG_PROMPT
    missing = {"context", "question"} - set(prompt.input_variables)
    if missing:
        raise ValueError(
            f"the prompt must have the variables context and question; missing: {sorted(missing)}"
        )

    def answer(inputs: dict[str, Any]) -> Runnable:
        documents = inputs["context"]
        fill = RunnableLambda(lambda x: {"context": format_documents(x["context"]), "question": x["input"]})
        return fill | prompt | llm.bind(documents=documents) | StrOutputParser()

    return (
        RunnableLambda(_as_inputs)
        | RunnablePassthrough.assign(context=itemgetter("input") | retriever)
        | RunnablePassthrough.assign(answer=RunnableLambda(answer))
    ).with_config(run_name="cacheblend_rag_chain")


def _as_inputs(question: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(question, str):
        return {"input": question}
    if isinstance(question, dict) and isinstance(question.get("input"), str):
        return question
    raise TypeError('the chain takes a question: a string or {"input": question}')
