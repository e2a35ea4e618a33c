"""``cacheblend-rag serve --engine vllm``: the same API over the vLLM engine (a real server process).
Stored chunks pasted into a chat prompt, or named by id in content parts, are blended through the KV
connector; the answer equals the PyTorch engine's; structured output goes through vLLM's guided decoding;
SIGTERM exits 0."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import httpx
import pytest

from cacheblend_rag.corpus.corpus import Corpus
from cacheblend_rag.engine import Engine, SamplingParams
from cacheblend_rag.rag import CacheBlendRAG
from cacheblend_rag.store.kvstore import KVStore

pytestmark = pytest.mark.vllm
# before any fixture builds a store: in an environment without vLLM the whole module is skipped at once
pytest.importorskip("vllm", reason="vLLM is not installed here; `make test` runs tests/vllm in .venv-vllm")

MAX_TOKENS = 12
QUESTION = "What is another notable work made by the author of Miss Sara Sampson?"


def _serve_support():
    path = Path(__file__).parents[1] / "server" / "serve_support.py"
    spec = importlib.util.spec_from_file_location("serve_support", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["serve_support"] = module
    return module


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory, sample_store) -> Path:
    copy = tmp_path_factory.mktemp("vllm-serve") / "corpus"
    shutil.copytree(sample_store, copy, ignore=shutil.ignore_patterns("*-shm", "*.lock"))
    return copy


def test_serve_over_the_vllm_engine(corpus_dir, model, tmp_path):
    support = _serve_support()
    with Corpus.open(corpus_dir) as corpus:
        chunks = corpus.get_chunks(list(corpus.db.iter_chunk_ids())[:2])
    server = support.start_server(corpus_dir, tmp_path / "serve.log", "--engine", "vllm")
    try:
        model_id = server.health()["model"]
        body = {
            "model": model_id,
            "messages": support.rag_messages([c.text for c in chunks], QUESTION),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        answer = support.post(server, "/chat/completions", body).json()
        extension = answer["cacheblend"]
        assert extension["engine"] == "vllm" and extension["chunk_ids"] == [c.chunk_id for c in chunks]
        # what was kept was read from a cache or computed for this request (the first to use the chunks);
        # OpenAI's cached_tokens counts only the reads
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == extension["cache_read_exact_tokens"] + extension["cache_read_blended_tokens"]
        assert cached <= extension["reused_tokens"] <= cached + extension["kv_computed_tokens"]
        assert extension["reused_tokens"] > 0

        lines = []
        with httpx.stream(
            "POST", f"{server.url}/chat/completions", json={**body, "stream": True}, timeout=300
        ) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        pieces = [json.loads(line[6:])["choices"][0]["delta"].get("content") or "" for line in lines]
        assert "".join(pieces) == answer["choices"][0]["message"]["content"]

        # the same chunks named by id in content parts: the same prompt, placed without a text search
        named = {**body, "messages": support.chunk_part_messages(extension["chunk_ids"], QUESTION)}
        by_id = support.post(server, "/chat/completions", named).json()
        assert by_id["choices"][0]["message"]["content"] == answer["choices"][0]["message"]["content"]
        assert by_id["usage"]["prompt_tokens"] == answer["usage"]["prompt_tokens"]
        assert by_id["cacheblend"]["chunk_ids"] == extension["chunk_ids"]
        assert by_id["cacheblend"]["reused_tokens"] == extension["reused_tokens"]

        # structured output through vLLM's guided decoding (a bounded schema, so it closes in the budget)
        schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 24}}}
        response_format = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
        structured = support.post(
            server, "/chat/completions", {**body, "max_tokens": 40, "response_format": response_format}
        ).json()
        assert set(json.loads(structured["choices"][0]["message"]["content"])) <= {"answer"}
        assert structured["choices"][0]["finish_reason"] == "stop"
    finally:
        assert server.stop() == 0, server.log_text()[-3000:]

    # the PyTorch engine's answer over the same chunks and the same prompt
    kv = KVStore(corpus_dir / "kv", model.fingerprint, model.shape)
    try:
        rag = CacheBlendRAG(corpus_dir, engine=Engine(model, store=kv))
        reference = rag.query(
            QUESTION, chunk_ids=[c.chunk_id for c in chunks], sampling=SamplingParams(MAX_TOKENS)
        )
    finally:
        kv.close()
    assert answer["choices"][0]["message"]["content"].strip() == reference.answer
