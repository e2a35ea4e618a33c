"""The corpus owns its chunk KV store: opened once per process, handed to every engine built over the
corpus, the one place chunk KV keys come from, closed by its last holder."""

from __future__ import annotations

import shutil

from cacheblend_rag.corpus.corpus import Corpus
from cacheblend_rag.engine import SamplingParams
from cacheblend_rag.ingest.pipeline import ingest
from cacheblend_rag.rag import CacheBlendRAG
from cacheblend_rag.settings import get_settings
from cacheblend_rag.store.keys import chunk_key
from cacheblend_rag.store.shared import shared_stores

TEXT = (
    "Gotthold Ephraim Lessing wrote Emilia Galotti, a play in five acts first performed in 1772.\n\n"
    "The Danube flows through ten countries before it reaches the Black Sea in Romania and Ukraine.\n"
)


def held(store) -> int:
    """References the process's registry holds on ``store`` (0: not held, closed by its last holder)."""
    return sum(n for (root, _, _), n in shared_stores().items() if root == str(store.root.resolve()))


def test_two_rags_over_one_corpus_dir_share_one_kv_store_closed_by_the_last(sample_store, tmp_path):
    corpus_dir = tmp_path / "store"
    shutil.copytree(sample_store, corpus_dir)
    first = CacheBlendRAG(corpus_dir, engine="torch")
    second = CacheBlendRAG(corpus_dir, engine="torch")
    assert first.corpus is not second.corpus  # two corpora opened, one store between them
    store = first.corpus.kv_store
    assert second.corpus.kv_store is store
    assert first.engine.store is store and second.engine.store is store
    assert held(store) == 2

    chunk = first.retrieve("Who wrote Emilia Galotti?", 1)[0]
    first.engine.chunk_kv(chunk.token_ids)  # computed through one, seen by the other's engine at once
    assert second.engine.store.contains(second.corpus.chunk_key(chunk.token_ids), remote=False)

    first.close()
    assert not store.closed and held(store) == 1  # the second still reads through it
    assert second.engine.chunk_kv(chunk.token_ids).num_tokens == chunk.n_tokens
    second.close()
    assert store.closed and held(store) == 0
    second.corpus.close()  # a corpus closed again gives nothing back twice
    assert held(store) == 0


def test_an_int8_corpus_keys_and_reads_its_chunks_in_int8_whatever_the_setting(
    tmp_path, monkeypatch, model_tokenizer
):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "notes.txt").write_text(TEXT)
    corpus_dir = tmp_path / "store"
    monkeypatch.setenv("CACHEBLEND_KV_DTYPE", "int8")
    get_settings.cache_clear()
    # the settings passed down, as the CLI does; the KV stage's engine writes through the corpus's store
    ingest([docs], corpus_dir, chunk_tokens=32, config=get_settings())
    monkeypatch.setenv("CACHEBLEND_KV_DTYPE", "float16")  # the setting now disagrees with the corpus
    get_settings.cache_clear()

    with Corpus.open(corpus_dir) as corpus:
        assert corpus.manifest.kv_dtype == "int8" and corpus.kv_store.kv_dtype_name == "int8"
        rag = CacheBlendRAG(corpus, engine="torch")
        try:
            assert rag.engine.store is corpus.kv_store  # an engine built over a corpus gets its store
            chunks = corpus.get_chunks(list(corpus.db.iter_chunk_ids()))
            assert len(chunks) >= 2
            context = corpus.chunk_context.key
            for chunk in chunks:
                key = corpus.chunk_key(chunk.token_ids)
                assert chunk.kv_key == key == rag.engine.chunk_key(chunk.token_ids)
                assert key == chunk_key(model_tokenizer.fingerprint, "int8", chunk.token_ids, context)
                assert key != chunk_key(model_tokenizer.fingerprint, "float16", chunk.token_ids, context)
                assert corpus.kv_store.contains(key, remote=False)  # precomputed at ingest, under this key
            puts = corpus.kv_store.counters.puts
            answer = rag.query(
                "Who wrote Emilia Galotti?",
                top_k=2,
                method="cacheblend",
                ratio=0.15,
                sampling=SamplingParams(max_tokens=4),
            )
            assert answer.reused_tokens > 0
            assert corpus.kv_store.counters.puts == puts  # every chunk read, none computed again
        finally:
            rag.close()
        assert not corpus.kv_store.closed  # the rag was given the corpus: the store stays the corpus's
