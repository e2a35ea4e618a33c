"""ChatCacheBlend.with_structured_output end to end: 20 real MuSiQue questions through a real LangChain RAG
chain over a CacheBlendVectorStore, answered by the default model (greedy) under a Pydantic schema and
under a TypedDict schema (with ``include_raw``), all 20/20 schema-valid; streaming, json_mode, the
function_calling alias, the LLM's ``response_format`` option, the README's example, and the errors
(``bind_tools``, unknown methods and schemas)."""

from __future__ import annotations

import json
import re
import runpy
from operator import itemgetter
from pathlib import Path
from typing import Literal

import pytest
from langchain_cacheblend import (
    CacheBlendLLM,
    CacheBlendRetriever,
    CacheBlendVectorStore,
    ChatCacheBlend,
    ToolCallingNotSupportedError,
    format_documents,
)
from langchain_core.messages import AIMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from pydantic import BaseModel, Field, TypeAdapter
from typing_extensions import TypedDict  # pydantic validates typing's TypedDict only from 3.12

from cacheblend_rag.errors import StructuredOutputError
from cacheblend_rag.frontend import response_format_for

pytestmark = pytest.mark.slow

DATA = Path(__file__).parents[1] / "data" / "musique_24.json"
README = Path(__file__).parents[2] / "README.md"
QUESTIONS = 20
MAX_TOKENS = 48
PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Answer from the context. Be brief."),
        ("human", "Context:\n{context}\n\nQuestion: {question}"),
    ]
)


class Answer(BaseModel):
    answer: str = Field(description="a few words")
    confidence: int = Field(ge=1, le=5)


class Finding(TypedDict):
    answer: str
    kind: Literal["person", "place", "organisation", "date", "other"]


@pytest.fixture(scope="module")
def musique(tmp_path_factory):
    """(store, questions): the first paragraph of each of 20 MuSiQue cases in a CacheBlendVectorStore (the
    user's own documents, tagged with their case), and the 20 questions."""
    cases = json.loads(DATA.read_text())[:QUESTIONS]
    texts, metadatas = [], []
    for n, case in enumerate(cases):
        for ctx in case["ctxs"][:1]:
            texts.append(f"{ctx['title']}\n{ctx['text']}")
            metadatas.append({"case": n})
    store = CacheBlendVectorStore.from_texts(
        texts, metadatas=metadatas, corpus_dir=tmp_path_factory.mktemp("structured") / "corpus"
    )
    yield store, [{"question": case["question"], "case": n} for n, case in enumerate(cases)]
    store.close()


@pytest.fixture(scope="module")
def llm(musique):
    model = ChatCacheBlend(corpus_dir=musique[0].corpus_dir, max_tokens=MAX_TOKENS)
    yield model
    model.close()


def rag_chain(store, structured):
    """A user-built RAG chain: each question's passages from the vector store, the prompt, the model."""

    def context(inputs: dict) -> str:
        return format_documents(
            store.similarity_search(inputs["question"], k=2, filter={"case": inputs["case"]})
        )

    return {"context": RunnableLambda(context), "question": itemgetter("question")} | PROMPT | structured


def test_twenty_questions_pydantic_all_valid(musique, llm):
    store, questions = musique
    results = rag_chain(store, llm.with_structured_output(Answer)).batch(questions)
    valid = [r for r in results if isinstance(r, Answer) and r.answer.strip() and 1 <= r.confidence <= 5]
    assert len(valid) == QUESTIONS, results
    # streaming yields partial objects of the class; the last is the whole answer, as in the batch
    chunks = list(rag_chain(store, llm.with_structured_output(Answer)).stream(questions[0]))
    assert chunks and all(isinstance(c, Answer) for c in chunks) and chunks[-1] == results[0]


def test_twenty_questions_typeddict_with_raw_all_valid(musique, llm):
    store, questions = musique
    results = rag_chain(store, llm.with_structured_output(Finding, include_raw=True)).batch(questions)
    finding = TypeAdapter(Finding)
    for result in results:
        assert set(result) == {"raw", "parsed", "parsing_error"} and result["parsing_error"] is None
        assert isinstance(result["raw"], AIMessage) and json.loads(result["raw"].content) == result["parsed"]
        assert finding.validate_python(result["parsed"], strict=True) == result["parsed"]
        assert set(result["parsed"]) == {"answer", "kind"}  # strict: no keys beyond the schema
        assert result["raw"].usage_metadata["input_token_details"]["cache_read"] > 0  # chunk KV reused
    assert sum(r["raw"].response_metadata["finish_reason"] == "stop" for r in results) == QUESTIONS


def test_json_mode_function_calling_alias_and_parsing_errors(musique, llm):
    store, questions = musique
    question = questions[3]
    # json_mode: any JSON object, parsed as a dict (the schema is not enforced, only used to parse)
    schema = {"title": "Reply", "type": "object", "properties": {"answer": {"type": "string"}}}
    got = rag_chain(store, llm.with_structured_output(schema, method="json_mode", include_raw=True)).invoke(
        question
    )
    assert got["parsing_error"] is None and isinstance(got["parsed"], dict)
    assert json.loads(got["raw"].content) == got["parsed"]
    # function_calling is served as json_schema: the same constrained answer
    alias = rag_chain(store, llm.with_structured_output(Answer, method="function_calling")).invoke(question)
    assert alias == rag_chain(store, llm.with_structured_output(Answer)).invoke(question)
    # a budget too small to close the JSON: include_raw reports the parsing error instead of raising
    short = ChatCacheBlend(corpus_dir=store.corpus_dir, max_tokens=4)
    try:
        cut = short.with_structured_output(Answer, include_raw=True).invoke("Who wrote Miss Sara Sampson?")
    finally:
        short.close()
    assert cut["parsed"] is None and cut["parsing_error"] is not None
    assert cut["raw"].response_metadata["finish_reason"] == "length"


def test_llm_takes_response_format_as_a_call_option(musique):
    store, questions = musique
    llm = CacheBlendLLM(corpus_dir=store.corpus_dir, max_tokens=MAX_TOKENS)
    try:
        text = llm.invoke(questions[5]["question"], response_format=response_format_for(Answer))
        Answer.model_validate_json(text)
        with pytest.raises(ValueError, match=r"response_format\.type must be"):
            llm.invoke("Hi", response_format={"type": "yaml"})
    finally:
        llm.close()


def test_readme_structured_output_example(corpus_dir, tmp_path):
    """The README's structured-output block, run as a script after the README's LangChain chain (its
    names given as the script's globals)."""
    block = README.read_text().split("<!-- structured-output example -->", 1)[1]
    script = tmp_path / "readme_structured_output.py"
    script.write_text(re.search(r"```python\n(.*?)```", block, re.DOTALL).group(1))
    llm = ChatCacheBlend(corpus_dir=corpus_dir, max_tokens=MAX_TOKENS)
    names = {
        "retriever": CacheBlendRetriever(corpus_dir=corpus_dir, k=2),
        "format_docs": format_documents,
        "prompt": PROMPT,
        "llm": llm,
        "RunnablePassthrough": RunnablePassthrough,
    }
    try:
        names = runpy.run_path(str(script), init_globals=names)
        assert isinstance(names["answer"], names["Answer"]) and 1 <= names["answer"].confidence <= 5
        raw = names["with_raw"].invoke("Who wrote Miss Sara Sampson?")
        assert isinstance(raw["parsed"], names["Answer"]) and raw["parsing_error"] is None
    finally:
        llm.close()


def test_tool_calling_and_bad_schemas_are_refused_clearly():
    llm = ChatCacheBlend(max_tokens=8)  # nothing here loads the model
    with pytest.raises(ToolCallingNotSupportedError, match="with_structured_output") as raised:
        llm.bind_tools([Answer])
    assert isinstance(raised.value, NotImplementedError) and "tool-calling chat template" in str(raised.value)
    with pytest.raises(ValueError, match="supported: json_schema, json_mode, function_calling"):
        llm.with_structured_output(Answer, method="tools")
    with pytest.raises(StructuredOutputError, match="uniqueItems"):
        llm.with_structured_output({"type": "array", "items": {"type": "string"}, "uniqueItems": True})
    with pytest.raises(ValueError, match="unsupported arguments"):
        llm.with_structured_output(Answer, tool_choice="any")
    with pytest.raises(ValueError, match="needs a schema"):
        llm.with_structured_output(None)
    with pytest.raises(ValueError, match="Pydantic model class, a TypedDict class or a JSON schema"):
        llm.with_structured_output(int)
    # an OpenAI tool description is taken as the schema of its parameters
    tool = {"type": "function", "function": {"name": "answer", "parameters": Answer.model_json_schema()}}
    bound = llm.with_structured_output(tool).first
    assert bound.kwargs["response_format"]["json_schema"]["schema"]["required"] == ["answer", "confidence"]
