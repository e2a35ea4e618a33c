"""A Redis restarted without persistence (``save ""``, no AOF) loses the pinned corpus KV; a replica over
the corpus notices (the pins marker is gone), says so and re-pins what the corpus holds.
Real Redis, killed and started again on its port."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from cacheblend_rag.engine import Engine, SamplingParams
from cacheblend_rag.ingest.pipeline import ingest
from cacheblend_rag.rag import CacheBlendRAG
from cacheblend_rag.store.kvstore import KVStore
from cacheblend_rag.store.remote import tier as remote_tier

DATA_DIR = Path(__file__).parents[1] / "data"
WAIT_S = 120.0  # an upper bound for the watcher to notice and re-pin, not a timing assertion


def pinned(redis_server) -> list[int]:
    client = redis_server.client()
    return [client.ttl(name) for name in client.scan_iter(match="cacheblend:kv:*")]


def test_a_replica_re_pins_the_corpus_after_a_restart_without_persistence(
    tmp_path, redis_server, model, embedder, monkeypatch, caplog
):
    monkeypatch.setattr(remote_tier, "PIN_CHECK_INTERVAL_S", 0.2)
    caplog.set_level(logging.WARNING)
    case = json.loads((DATA_DIR / "musique_case0.json").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "case0.txt").write_text("\n\n".join(case["paragraphs"][:2]) + "\n")
    engine = Engine(
        model,
        store=KVStore(
            tmp_path / "a" / "kv", model.fingerprint, model.shape, "float16", remote=redis_server.url
        ),
    )
    summary = ingest([docs], tmp_path / "a", chunk_tokens=128, engine=engine)
    assert summary.kv_remote_pinned == summary.new_chunks >= 2
    rag = CacheBlendRAG(tmp_path / "a", engine=engine)  # a replica serving the corpus
    assert pinned(redis_server) == [-1] * summary.new_chunks

    port = redis_server.port
    redis_server.kill()
    redis_server.start(port=port)  # nothing persisted: it comes back empty
    assert pinned(redis_server) == []

    deadline = time.monotonic() + WAIT_S
    while pinned(redis_server) != [-1] * summary.new_chunks and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pinned(redis_server) == [-1] * summary.new_chunks  # every chunk pinned again, no TTL
    messages = [r.getMessage() for r in caplog.records]
    assert any("lost its pinned corpus KV" in m and "re-pinning" in m for m in messages), messages
    deadline = time.monotonic() + WAIT_S
    while not any("re-pinned" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any(f"re-pinned {summary.new_chunks} chunks" in r.getMessage() for r in caplog.records)
    assert rag.query(case["question"], top_k=2, sampling=SamplingParams(max_tokens=4)).answer
    engine.close()
