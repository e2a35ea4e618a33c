"""The KV precompute stage end to end: real model, real engine, real KV store under the store directory."""

from __future__ import annotations

import sqlite3

import pytest

from cacheblend_rag.corpus.chunkdb import DB_NAME
from cacheblend_rag.corpus.corpus import Corpus
from cacheblend_rag.engine import Engine
from cacheblend_rag.ingest.pipeline import ingest
from cacheblend_rag.store.keys import kv_bytes_per_token

TEXT = (
    "Gotthold Ephraim Lessing wrote Emilia Galotti, a play in five acts first performed in 1772.\n\n"
    "Lessing also wrote Miss Sara Sampson, one of the first domestic tragedies in German, in 1755. "
    "His play Nathan the Wise pleads for religious tolerance.\n\n"
    "The Danube flows through ten countries before it reaches the Black Sea in Romania and Ukraine.\n"
)


@pytest.fixture
def small_store(tmp_path, model, embedder):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "notes.txt").write_text(TEXT)
    store = tmp_path / "store"
    engine = Engine(model=model, store=store / "kv")
    yield docs, store, engine
    engine.store.close()


def kv_keys(store) -> dict[str, str]:
    with sqlite3.connect(store / DB_NAME) as db:
        return dict(db.execute("SELECT chunk_id, kv_key FROM chunks").fetchall())


def test_kv_stage_precomputes_once_resumes_and_drops_replaced_chunks(small_store, model):
    docs, store, engine = small_store
    first = ingest([docs], store, chunk_tokens=32, engine=engine)
    assert first.new_chunks >= 3 and first.kv_chunks == first.new_chunks
    per_token = kv_bytes_per_token(model.shape, engine.store.kv_dtype_name, 32)  # its codec's, scales too
    assert first.kv_bytes >= per_token * first.tokens
    keys = kv_keys(store)
    with Corpus.open(store) as corpus:
        assert corpus.stats().kv_ready == len(keys)
        for chunk in corpus.get_chunks(list(keys)):
            assert chunk.kv_key == engine.chunk_key(chunk.token_ids)
            assert engine.store.contains(chunk.kv_key)
            assert engine.chunk_kv(chunk.token_ids).num_tokens == chunk.n_tokens

    again = ingest([docs], store, engine=engine)
    assert (again.files_changed, again.kv_chunks, again.kv_bytes) == (0, 0, 0)

    # a crash between the KV write and its bookkeeping, and a KV file lost: the next run repairs both
    lost, unmarked = sorted(keys)[:2]
    engine.store.delete(keys[lost])
    with sqlite3.connect(store / DB_NAME) as db:
        db.execute("UPDATE chunks SET kv_ready = 0 WHERE chunk_id IN (?, ?)", (lost, unmarked))
    resumed = ingest([docs], store, engine=engine)
    assert resumed.files_changed == 0 and resumed.kv_chunks == 1 and resumed.kv_bytes > 0
    assert engine.store.contains(keys[lost])
    with Corpus.open(store) as corpus:
        assert corpus.stats().kv_ready == len(keys)

    # a changed file: chunks no document uses any more lose their KV, the new ones get theirs
    (docs / "notes.txt").write_text(TEXT.replace("Danube", "Dnieper"))
    changed = ingest([docs], store, engine=engine)
    assert changed.removed_chunks >= 1 and changed.kv_chunks == changed.new_chunks >= 1
    new_keys = kv_keys(store)
    for chunk_id, key in keys.items():
        assert engine.store.contains(key) == (chunk_id in new_keys)
    assert all(engine.store.contains(key) for key in new_keys.values())
