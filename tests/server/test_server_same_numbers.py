"""The same request reports the same numbers against a fresh ``serve``: the budget it chose, its prompt
and cached tokens and its recompute ratio, whether it came first after start, after others, or with
others at once (then fused in one round: docs/rounds.md)."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from serve_support import rag_messages, start_server

from cacheblend_rag.frontend import get_corpus
from cacheblend_rag.ingest.pipeline import ingest

pytestmark = pytest.mark.slow

# short chunks (the adaptive budget's short-chunk share applies) over a little of the sample corpus, so
# that ingest precomputes their KV quickly
CHUNK_TOKENS = 118
SAMPLE = Path(__file__).parents[2] / "examples" / "data" / "corpus" / "musique_case013.txt"
QUESTION = "Who wrote The Unwinding?"


@pytest.fixture(scope="module")
def ingested(tmp_path_factory) -> Path:
    """A corpus just ingested with its chunk KV precomputed (on disk; the template's opening not yet
    computed by any request), as a user has it before the first ``serve``."""
    text = SAMPLE.read_text()[:2200]
    source = tmp_path_factory.mktemp("docs") / "sample.txt"
    source.write_text(text[: text.rindex(" ")])
    corpus = tmp_path_factory.mktemp("same") / "corpus"
    summary = ingest([source], corpus, chunk_tokens=CHUNK_TOKENS, precompute_kv=True)
    assert summary.kv_chunks >= 3
    return corpus


def numbers(server, body: dict) -> tuple:
    """What must not depend on what else ran: the budget, prompt and cached tokens, the ratio."""
    response = httpx.post(f"{server.url}/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    data = response.json()
    extension = data["cacheblend"]
    usage = data["usage"]
    assert extension["kv_computed_tokens"] == 0  # read from the store, every time
    return (
        tuple(sorted((extension["budget"] or {}).items())),
        usage["prompt_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
        extension["cached_tokens"],
        extension["recompute_ratio"],
    )


def test_the_same_request_reports_the_same_numbers_first_after_others_and_at_once(ingested, tmp_path_factory):
    corpus = get_corpus(ingested)
    chunks = corpus.get_chunks(list(corpus.db.iter_chunk_ids())[:3])
    body = {
        "messages": rag_messages([c.text for c in chunks], QUESTION),
        "chunk_ids": [c.chunk_id for c in chunks],
        "max_tokens": 2,
        "temperature": 0,
    }
    server = start_server(ingested, tmp_path_factory.mktemp("logs") / "serve.log")
    try:
        body["model"] = server.health()["model"]
        sequential = [numbers(server, body) for _ in range(10)]
        together: list[tuple | BaseException] = [None] * 8

        def send(i: int) -> None:
            try:
                together[i] = numbers(server, body)
            except BaseException as exc:  # raised in the test's thread below
                together[i] = exc

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(together))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        log = server.log_text()
    finally:
        assert server.stop() == 0, server.log_text()[-3000:]
    for found in together:
        if isinstance(found, BaseException):
            raise found
    budget, prompt_tokens, cached, _, ratio = sequential[0]
    assert dict(budget)["short"] and dict(budget)["chunks"] == 3, budget
    assert 0 < cached < prompt_tokens and 0 < ratio < 1
    assert set(sequential) == set(together) == {sequential[0]}, (sequential, together, log[-3000:])
