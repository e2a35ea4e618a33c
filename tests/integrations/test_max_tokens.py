"""One API, one habit: ``max_tokens`` is accepted by every entry point (``sampling=`` still works),
the answer length has that one name everywhere, and the answer length when none is given is one setting
with one default (``config.DEFAULT_MAX_TOKENS``, ``CACHEBLEND_MAX_TOKENS``) wherever the call comes
from. Real engine over the shared sample store."""

from __future__ import annotations

import inspect

import pytest
from langchain_cacheblend import CacheBlendLLM as LangChainLLM
from langchain_cacheblend import ChatCacheBlend
from llama_index.llms.cacheblend import CacheBlendLLM as LlamaIndexLLM
from typer.testing import CliRunner

from cacheblend_rag.cli import app
from cacheblend_rag.cli.query import query as query_command
from cacheblend_rag.cli.serve import serve as serve_command
from cacheblend_rag.config import DEFAULT_MAX_TOKENS, Config
from cacheblend_rag.engine import SamplingParams
from cacheblend_rag.frontend import get_frontend
from cacheblend_rag.frontend.prompt_frontend import text_request
from cacheblend_rag.server.app import create_app
from cacheblend_rag.server.protocol import GenerationSpec
from cacheblend_rag.settings import get_settings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rag(corpus_dir):
    return get_frontend(corpus_dir, config=get_settings()).rag


def test_query_stream_batch_and_round_take_max_tokens(rag, question):
    result = rag.query(question, top_k=2, max_tokens=3)
    assert result.finish_reason == "length" and result.answer
    handle = rag.stream(question, top_k=2, max_tokens=2)
    assert len(list(handle)) == 2 and handle.result().finish_reason == "length"
    for results in (
        rag.query_batch([question, question], top_k=2, max_tokens=2),
        rag.query_round([question, question], top_k=2, max_tokens=2),
    ):
        assert [r.finish_reason for r in results] == ["length", "length"]
    # the older spelling still works, and max_tokens wins over it when both are given
    assert rag.query(question, top_k=2, sampling=SamplingParams(max_tokens=2)).finish_reason == "length"
    handle = rag.stream(question, top_k=2, sampling=SamplingParams(max_tokens=9), max_tokens=1)
    assert len(list(handle)) == 1


def test_check_takes_max_tokens_too(rag, question):
    report = rag.check([question], ratios=(0.15,), max_tokens=1, top_k=2)
    assert report.max_tokens == 1
    with pytest.raises(TypeError, match="max_new_tokens"):  # one name for the answer length
        rag.check([question], ratios=(0.15,), max_new_tokens=1, top_k=2)


def test_one_default_answer_length_everywhere(corpus_dir, monkeypatch):
    assert Config().max_tokens == DEFAULT_MAX_TOKENS
    assert SamplingParams().max_tokens == DEFAULT_MAX_TOKENS
    assert text_request("q").sampling.max_tokens == DEFAULT_MAX_TOKENS
    assert GenerationSpec().max_tokens == DEFAULT_MAX_TOKENS
    assert inspect.signature(create_app).parameters["default_max_tokens"].default == DEFAULT_MAX_TOKENS
    for command in (query_command, serve_command):  # None: the setting's value
        assert inspect.signature(command).parameters["max_tokens"].default is None
    for model in (ChatCacheBlend, LangChainLLM, LlamaIndexLLM):
        assert model(corpus_dir=corpus_dir).max_tokens == DEFAULT_MAX_TOKENS, model
    # one setting changes them all
    monkeypatch.setenv("CACHEBLEND_MAX_TOKENS", "7")
    get_settings.cache_clear()
    for model in (ChatCacheBlend, LangChainLLM, LlamaIndexLLM):
        assert model(corpus_dir=corpus_dir).max_tokens == 7, model


def test_cli_query_default_comes_from_the_setting(corpus_dir, question, monkeypatch):
    monkeypatch.setenv("CACHEBLEND_MAX_TOKENS", "2")
    get_settings.cache_clear()
    result = CliRunner().invoke(app, ["query", question, "--corpus", corpus_dir, "--top-k", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert '"finish_reason": "length"' in result.stdout


def test_empty_chunk_ids_is_refused_by_name(rag, question):
    with pytest.raises(ValueError, match="chunk_ids is empty"):
        rag.query(question, chunk_ids=[])
    with pytest.raises(ValueError, match="chunk_ids is empty"):
        rag.query_round([question], chunk_ids=[])
