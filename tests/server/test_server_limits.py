"""``serve`` refuses what it cannot use before working on it: a request body over the limit (413, at
once, whatever its size), and an empty ``chunk_ids`` (400 naming it); a request without ``max_tokens``
gets the one ``max_tokens`` setting. One real server process on loopback."""

from __future__ import annotations

import time

import httpx
import pytest
from serve_support import error_of, post, start_server

pytestmark = pytest.mark.slow

LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def server(served_corpus, tmp_path_factory):
    env = {"CACHEBLEND_MAX_REQUEST_BYTES": str(LIMIT), "CACHEBLEND_MAX_TOKENS": "3"}
    process = start_server(served_corpus, tmp_path_factory.mktemp("logs") / "serve.log", env=env)
    yield process
    process.stop()


def chat(content: str, **extra) -> dict:
    return {"model": "any", "messages": [{"role": "user", "content": content}], **extra}


def test_an_oversized_body_is_refused_at_once_with_413(server):
    model = server.health()["model"]
    answered = 0
    for size in (LIMIT + 1, 50 * 1024 * 1024):
        body = chat("x" * size) | {"model": model}
        started = time.perf_counter()
        try:
            response = post(server, "/chat/completions", body)
        except httpx.TransportError:  # the server answered and closed before the client sent 50 MB
            assert size > LIMIT + 1
            continue
        answered += 1
        assert time.perf_counter() - started < 10
        assert response.status_code == 413, response.text
        error = error_of(response)
        assert error["code"] == "request_too_large" and f"{LIMIT:,} bytes" in error["message"]
    assert answered >= 1
    # a body sent in chunks, without a Content-Length, is cut off as soon as it passes the limit
    chunks = (b"x" * 65536 for _ in range(64))
    response = httpx.post(f"{server.url}/chat/completions", content=chunks, timeout=60)
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"


def test_a_small_request_is_served_with_the_max_tokens_setting(server):
    model = server.health()["model"]
    response = post(server, "/chat/completions", chat("Name a river in Europe.", model=model))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 3


def test_empty_chunk_ids_is_refused_by_name(server):
    model = server.health()["model"]
    response = post(server, "/chat/completions", chat("Hello", model=model, chunk_ids=[]))
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "chunk_ids" and "chunk_ids is empty" in error["message"]
