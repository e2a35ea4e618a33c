"""Two ingest processes and four query threads on one store at once, for a bounded run: no exception, no
corrupted file, and every answer equals the single-threaded answer for the same question and method."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

from reliability_support import (
    CHUNK_TOKENS,
    TOP_K,
    answer,
    kv_files,
    start_child,
    store_verify,
    temp_files,
    wait_for,
)

from cacheblend_rag.corpus.chunkdb import DB_NAME
from cacheblend_rag.store.kvstore import KVStore

THREADS = 4
RUN_LIMIT_S = 300.0  # a bound on the run, far above what it needs on an idle 2-core machine
DATA_DIR = Path(__file__).parents[1] / "data"


def _unrelated_document(folder: Path) -> Path:
    """A short document on another topic (a MuSiQue paragraph about an electric cooperative)."""
    case = json.loads((DATA_DIR / "musique_24.json").read_text())[1]
    text = case["ctxs"][0]["text"]
    start = text.index("the southern maryland electric cooperative")
    end = text.index(". ", start + 400) + 1
    folder.mkdir()
    path = folder / "smeco.txt"
    path.write_text(text[start:end] + "\n")
    return folder


def test_two_ingests_and_four_query_threads(
    store_copy, rel_docs, rel_questions, reference, rag_on, faults, tmp_path
):
    cases = [(q, m) for q in rel_questions for m in ("cacheblend", "full_reuse")]
    cases += [(q, "full_recompute") for q in rel_questions[:2]]
    want = reference.answers(cases)
    root = store_copy()
    # the chunks every question retrieves first lose their KV: ingest 1 computes them while the query
    # threads compute and write them back too
    pending = list(dict.fromkeys(reference.kv_keys(q)[0] for q in rel_questions))
    with KVStore.open_existing(root / "kv") as kv:
        for key in pending:
            kv.delete(key)
    with sqlite3.connect(root / DB_NAME) as db:
        db.execute(
            f"UPDATE chunks SET kv_ready = 0 WHERE kv_key IN ({','.join('?' * len(pending))})", pending
        )
        chunks_before = db.execute("SELECT count(*) FROM chunks").fetchone()[0]
    extra = _unrelated_document(tmp_path / "extra")
    sync = tmp_path / "sync"
    sync.mkdir()

    children = [
        start_child("ingest", root, sync, rel_docs, "--chunk-tokens", CHUNK_TOKENS),  # KV of pending chunks
        start_child("ingest", root, sync, extra, "--chunk-tokens", CHUNK_TOKENS),  # a new document
    ]
    got: dict[tuple[str, str], list[str]] = {case: [] for case in cases}
    errors: list[BaseException] = []
    spans: list[tuple[float, float]] = []  # wall-clock (start, end) of each query
    with rag_on(root) as rag:
        deadline = time.monotonic() + RUN_LIMIT_S

        def ask(mine: list[tuple[str, str]]) -> None:
            try:
                for case in mine:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"run limit of {RUN_LIMIT_S:.0f} s reached")
                    started = time.time()
                    got[case].append(answer(rag, *case))
                    spans.append((started, time.time()))
            except BaseException as exc:  # every failure of a thread fails the test
                errors.append(exc)

        for child in children:  # both have loaded the model and wait for the start
            wait_for(sync / f"ready-{child.pid}", child)
        threads = [threading.Thread(target=ask, args=(cases[i::THREADS],)) for i in range(THREADS)]
        for thread in threads:
            thread.start()
        (sync / "go").touch()
        for thread in threads:
            thread.join(RUN_LIMIT_S + 60)
        outputs = [child.communicate(timeout=RUN_LIMIT_S) for child in children]
        assert not errors, errors
        assert [child.returncode for child in children] == [0, 0], [err[-3000:] for _, err in outputs]
        summaries = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
        # retrieval saw the new document come in; it must not have changed what the questions retrieve
        for question in rel_questions:
            assert [c.chunk_id for c in rag.retrieve(question, TOP_K)] == reference.chunk_ids(question)
        stats = rag.corpus.stats()

    # the run is only a test of concurrency if queries really ran while the ingests worked
    overlapping = sum(
        any(start < s["ended"] and s["started"] < end for s in summaries) for start, end in spans
    )
    assert overlapping >= 1, (spans, [(s["started"], s["ended"]) for s in summaries])
    answers = {case: answers[0] for case, answers in got.items() if len(answers) == 1}
    assert len(answers) == len(cases)
    # whichever ingest ran first computed the pending KV (the threads may have stored some before it)
    assert summaries[0]["files_changed"] == 0 and summaries[1]["new_chunks"] >= 1
    assert stats.chunks == chunks_before + summaries[1]["new_chunks"] and stats.kv_ready == stats.chunks
    code, report = store_verify(root)
    assert code == 0 and report["clean"] and report["ok"] == stats.chunks, report
    assert len(kv_files(root)) == stats.chunks and not temp_files(root)
    handling = f"{len(cases)} queries in {THREADS} threads, {overlapping} during ingest work; verify clean"
    assert not faults.record("concurrency", "2 ingest processes + 4 query threads", handling, answers, want)
