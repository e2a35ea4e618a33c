"""Corpus retrieval on the real sample corpus: search quality, look-ups, id validation, added texts."""

from __future__ import annotations

import json
import math
import shutil
import sqlite3
from pathlib import Path

import pytest

from cacheblend_rag.corpus.chunkdb import DB_NAME
from cacheblend_rag.corpus.corpus import Corpus
from cacheblend_rag.errors import ChunkNotFoundError, InvalidChunkIdError, InvalidQueryError, StoreError
from cacheblend_rag.ingest.readers import read_file
from cacheblend_rag.text.chunker import Chunker

CORPUS_DIR = Path(__file__).parents[2] / "examples" / "data" / "corpus"


@pytest.fixture(scope="module")
def corpus(sample_store):
    with Corpus.open(sample_store) as opened:
        yield opened


@pytest.fixture
def writable_corpus(sample_store, tmp_path):
    copy = tmp_path / "store"
    shutil.copytree(sample_store, copy)
    with Corpus.open(copy) as opened:
        yield opened


def test_each_demo_question_retrieves_its_answer(corpus, sample_questions):
    assert len(sample_questions) == 4
    for item in sample_questions:
        hits = corpus.search(item["question"], top_k=6)
        assert len(hits) == 6
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
        answer = item["answers"][0].lower()
        with_answer = [h for h in hits if answer in h.text.lower()]
        assert with_answer, f"no retrieved chunk holds {answer!r} for {item['question']!r}"
        # most hits come from the question's own case, not from the three others
        own = [h for h in hits if h.metadata["source"].endswith(Path(item["file"]).name)]
        assert len(own) >= 4, [h.metadata["source"] for h in hits]


def test_stored_chunks_are_exactly_the_chunker_output(corpus, model_tokenizer):
    chunker = Chunker(model_tokenizer.tokenizer, corpus.manifest.chunk_tokens)
    path = CORPUS_DIR / "musique_case013.txt"
    [doc] = read_file(path)
    expected = chunker.split(doc.text)
    stored = corpus.get_chunks([c.chunk_id for c in expected])
    assert [s.text for s in stored] == [c.text for c in expected]
    assert [s.token_ids for s in stored] == [c.token_ids for c in expected]
    assert "".join(s.text for s in stored) == doc.text
    for chunk in stored:
        assert chunker.tokenize(chunk.text) == list(chunk.token_ids)  # text <-> ids consistent
        assert math.isnan(chunk.score)
        assert chunk.metadata["source"] == str(path.resolve())
        assert len(chunk.kv_key) == 64


def test_jsonl_metadata_and_titles_come_back(corpus):
    hit = corpus.search("Eddie Argos singer of Art Brut", top_k=1)[0]
    assert hit.title == "MuSiQue passages, case 10"
    assert hit.metadata["dataset"] == "musique_s" and hit.metadata["case"] == 10
    assert hit.metadata["id"].startswith("case10-")


def test_get_chunks_keeps_order_and_duplicates(corpus):
    ids = [h.chunk_id for h in corpus.search("Peace Corps volunteer in Togo", top_k=3)]
    wanted = [ids[2], ids[0], ids[2]]
    assert [c.chunk_id for c in corpus.get_chunks(wanted)] == wanted
    assert corpus.get_chunks([]) == []


@pytest.mark.parametrize(
    "bad",
    [
        "../../../etc/passwd",
        "..%2F..%2Fmanifest.json",
        "' OR 1=1; DROP TABLE chunks; --",
        "0" * 31 + "'",
        "%" * 32,
        "ABCDEF0123456789ABCDEF0123456789",
        "0" * 64,
        "",
        None,
    ],
)
def test_malformed_ids_are_rejected_before_any_lookup(corpus, sample_store, bad):
    with pytest.raises(InvalidChunkIdError):
        corpus.get_chunks([bad])
    with sqlite3.connect(sample_store / DB_NAME) as db:  # nothing was dropped or changed
        assert db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0] == corpus.stats().chunks > 0


def test_unknown_id_is_not_found(corpus):
    known = corpus.search("Lessing", top_k=1)[0].chunk_id
    with pytest.raises(ChunkNotFoundError, match=r"no chunk 0{32}"):
        corpus.get_chunks([known, "0" * 32])


def test_find_by_text_is_exact(corpus):
    chunk = corpus.search("Patrick Modiano Nobel Prize", top_k=1)[0]
    found = corpus.find_by_text(chunk.text)
    assert found is not None and found.chunk_id == chunk.chunk_id and found.token_ids == chunk.token_ids
    assert corpus.find_by_text(chunk.text + " ") is None
    assert corpus.find_by_text(chunk.text[:-1]) is None
    assert corpus.find_by_text("") is None


def test_bad_queries(corpus):
    with pytest.raises(InvalidQueryError, match="empty"):
        corpus.search("   ")
    for top_k in (0, -1, 10_001, 2.5):
        with pytest.raises(InvalidQueryError, match="top_k"):
            corpus.search("Lessing", top_k=top_k)
    assert len(corpus.search("Lessing", top_k=1000)) == corpus.stats().chunks  # capped by the corpus size


def test_stats(corpus):
    stats = corpus.stats()
    assert (stats.files, stats.documents) == (4, 7)
    assert stats.chunks == stats.index_size >= 25
    assert stats.tokens > 10_000 and stats.kv_ready == 0
    assert stats.model == "SmolLM2-135M-Instruct" and stats.embedder == "all-MiniLM-L6-v2"


def test_add_texts_stores_new_text_once_and_finds_existing(writable_corpus):
    corpus = writable_corpus
    before = corpus.stats().chunks
    existing = corpus.search("Emilia Galotti", top_k=1)[0]
    text = "The lighthouse of Alexandria was one of the Seven Wonders of the Ancient World."
    ids = corpus.add_texts([text, existing.text, text], titles=["Pharos", None, "Pharos"])
    assert ids[1] == [existing.chunk_id] and ids[0] == ids[2] and len(ids[0]) == 1
    assert corpus.stats().chunks == before + 1
    [added] = corpus.get_chunks(ids[0])
    assert added.text == text and added.title == "Pharos"
    assert corpus.search("Which ancient wonder was a lighthouse?", top_k=1)[0].chunk_id == ids[0][0]
    assert corpus.add_texts([text]) == [ids[0]]
    assert corpus.stats().chunks == before + 1
    long_text = "\n\n".join(f"Paragraph {i}. " + "Ships saw its fire from far away. " * 30 for i in range(8))
    [long_ids] = corpus.add_texts([long_text])
    assert len(long_ids) > 1
    assert "".join(c.text for c in corpus.get_chunks(long_ids)) == long_text
    with pytest.raises(InvalidQueryError):
        corpus.add_texts(["  "])
    with pytest.raises(TypeError):
        corpus.add_texts(text)


def test_added_texts_survive_reopen(writable_corpus):
    store = writable_corpus.corpus_dir
    [[chunk_id]] = writable_corpus.add_texts(["Zebras have black and white stripes that confuse flies."])
    writable_corpus.close()
    with Corpus.open(store) as reopened:
        assert reopened.search("striped animal and flies", top_k=1)[0].chunk_id == chunk_id
        assert reopened.stats().index_size == reopened.stats().chunks


def test_open_rejects_non_stores_and_foreign_formats(tmp_path, sample_store):
    with pytest.raises(StoreError, match="not a cacheblend-rag store"):
        Corpus.open(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(sample_store, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["format_version"] = 99
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="format 99 is not supported"):
        Corpus.open(copy)
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(StoreError, match="unreadable manifest"):
        Corpus.open(copy)
