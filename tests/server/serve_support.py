"""Helpers of the server tests (importable as ``serve_support``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from cacheblend_rag.engine.prompt import CHUNK_SEPARATOR, DEFAULT_SYSTEM_PROMPT, DEFAULT_USER_TEMPLATE
from cacheblend_rag.server.process import ServerProcess

# children share two cores with pytest; wide log lines, so that a warning is one line of a log
CHILD_ENV = {"CACHEBLEND_THREADS": "1", "OMP_NUM_THREADS": "1", "COLUMNS": "400"}


def server_process(corpus: Path, log: Path, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    """A ``serve`` child process over ``corpus`` (not started)."""
    return ServerProcess(corpus, log, *args, env={**CHILD_ENV, **(env or {})})


def start_server(corpus: Path, log: Path, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    return server_process(corpus, log, *args, env=env).start()


def run_cli(*args: object, timeout: float = 600) -> subprocess.CompletedProcess:
    """``cacheblend-rag ARGS...`` in a child process."""
    argv = [sys.executable, "-m", "cacheblend_rag", *map(str, args)]
    return subprocess.run(
        argv, capture_output=True, text=True, env={**os.environ, **CHILD_ENV}, timeout=timeout
    )


def rag_messages(texts: list[str], question: str) -> list[dict[str, str]]:
    """The engine's own RAG prompt (what ``CacheBlendRAG.query`` builds) as chat messages, the passages
    pasted in as text: what any OpenAI client would send."""
    passages = CHUNK_SEPARATOR.join(texts)
    return [
        {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
        {"role": "user", "content": DEFAULT_USER_TEMPLATE.format(passages=passages, question=question)},
    ]


def chunk_part_messages(chunk_ids: list[str], question: str) -> list[dict[str, Any]]:
    """The same prompt as :func:`rag_messages` with the passages named by id: a ``chunk`` content part
    per stored chunk, the template's text around them."""
    before, after = DEFAULT_USER_TEMPLATE.split("{passages}")
    content: list[dict[str, str]] = [{"type": "text", "text": before}]
    for i, chunk_id in enumerate(chunk_ids):
        if i:
            content.append({"type": "text", "text": CHUNK_SEPARATOR})
        content.append({"type": "chunk", "chunk_id": chunk_id})
    content.append({"type": "text", "text": after.format(question=question)})
    return [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": content}]


def cli_query(
    corpus: Path, question: str, chunk_ids: list[str], max_tokens: int, *args: str
) -> dict[str, Any]:
    """``cacheblend-rag query --json`` in a child process: the answer the server must match."""
    ids = [a for c in chunk_ids for a in ("--chunk-id", c)]
    done = run_cli("query", "--corpus", corpus, "--json", "--max-tokens", max_tokens, *ids, *args, question)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def post(server: ServerProcess, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120, **kwargs)


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object of a response (asserting the body has exactly that shape)."""
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"], body
    return body["error"]
