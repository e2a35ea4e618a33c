"""kill -9 in the middle of writing chunk KV, during an ingest and during a query that writes KV back: after
a restart the store is consistent, no partial file is ever read, ingest resumes where it stopped and every
answer equals the fault-free run's."""

from __future__ import annotations

import sqlite3

import pytest
from reliability_support import (
    CHUNK_TOKENS,
    TOP_K,
    answer,
    kill_when_stalled,
    kv_path,
    start_child,
    store_verify,
    temp_files,
)

from cacheblend_rag.corpus.chunkdb import DB_NAME
from cacheblend_rag.engine import Engine
from cacheblend_rag.ingest.pipeline import ingest
from cacheblend_rag.store.kvstore import KVStore


def _drop_kv(root, keys: list[str], mark_pending: bool) -> None:
    """Remove the stored KV of ``keys``; with ``mark_pending``, as if ingest had not computed it yet."""
    with KVStore.open_existing(root / "kv") as kv:
        for key in keys:
            kv.delete(key)
    if mark_pending:
        with sqlite3.connect(root / DB_NAME) as db:
            db.execute(f"UPDATE chunks SET kv_ready = 0 WHERE kv_key IN ({','.join('?' * len(keys))})", keys)


def _kv_ready(root) -> dict[str, int]:
    with sqlite3.connect(root / DB_NAME) as db:
        return dict(db.execute("SELECT kv_key, kv_ready FROM chunks").fetchall())


def test_kill_9_during_ingest_kv_write_then_resume(
    store_copy, rel_docs, rel_questions, reference, model, rag_on, faults, tmp_path
):
    cases = [(q, "cacheblend") for q in rel_questions]
    want = reference.answers(cases)
    root = store_copy()
    pending = list(dict.fromkeys(reference.kv_keys(q)[0] for q in rel_questions))
    assert len(pending) > 1
    _drop_kv(root, pending, mark_pending=True)
    sync = tmp_path / "sync"
    sync.mkdir()
    (sync / "go").touch()

    # the second KV file of the run stops half written; then the process is killed
    child = start_child("ingest", root, sync, rel_docs, "--chunk-tokens", CHUNK_TOKENS, "--stall-write", 2)
    kill_when_stalled(child, sync)

    ready = _kv_ready(root)
    done = [key for key in pending if ready[key]]
    assert len(done) == 1 and kv_path(root, done[0]).exists()  # the first chunk was stored and recorded
    assert len(temp_files(root)) == 1  # the half-written file never got its final name
    with KVStore.open_existing(root / "kv") as kv:
        for key in pending:
            if key not in done:
                assert kv.get(key) is None and not kv_path(root, key).exists()
        assert kv.counters.corrupt == 0  # a plain miss: nothing partial was read
    code, report = store_verify(root)
    assert code == 1 and len(report["stale_temp_files"]) == 1 and not report["corrupt"], report

    engine = Engine(model=model, store=root / "kv")
    try:
        resumed = ingest([rel_docs], root, engine=engine)
    finally:
        engine.store.close()
    assert (resumed.files_changed, resumed.kv_chunks) == (0, len(pending) - 1)  # resumed where it stopped
    assert all(_kv_ready(root).values())
    code, _ = store_verify(root, repair=True)
    assert code == 0 and not temp_files(root)
    assert store_verify(root)[0] == 0
    with rag_on(root) as rag:
        got = {case: answer(rag, *case) for case in cases}
    handling = f"half file stays a temp, never read; rerun resumes ({len(pending) - 1} left); repair drops it"
    assert not faults.record("crash", "kill -9 mid KV file write during ingest", handling, got, want)


@pytest.mark.parametrize(
    ("stall", "fault", "handling"),
    [
        (
            "write",
            "kill -9 mid KV write-back of a query",
            "half file stays a temp, never read; restart recomputes",
        ),
        (
            "index",
            "kill -9 after rename, before the index row",
            "complete file without row: checked, served, row re-created",
        ),
    ],
    ids=["mid-write", "before-index"],
)
def test_kill_9_during_query_write_back(
    stall, fault, handling, store_copy, rel_questions, reference, rag_on, faults, tmp_path
):
    question = rel_questions[0]
    cases = [(question, "cacheblend"), (question, "full_reuse")]
    want = reference.answers(cases)
    root = store_copy()
    missing = reference.kv_keys(question)[0]
    _drop_kv(root, [missing], mark_pending=False)
    sync = tmp_path / "sync"
    sync.mkdir()

    child = start_child("query", root, sync, question, "cacheblend", "--top-k", TOP_K, "--stall", stall)
    kill_when_stalled(child, sync)

    code, report = store_verify(root)
    assert code == 1 and not report["corrupt"], report
    if stall == "write":
        assert len(report["stale_temp_files"]) == 1 and not kv_path(root, missing).exists()
    else:
        assert report["orphan_files"] == [missing] and not temp_files(root)
    with rag_on(root) as rag:  # the restart
        got = {case: answer(rag, *case) for case in cases}
        assert rag.engine.store.counters.corrupt == 0
    assert kv_path(root, missing).exists()
    code, _ = store_verify(root, repair=True)
    assert code == 0 and store_verify(root)[0] == 0 and not temp_files(root)
    assert not faults.record("crash", fault, handling, got, want)
