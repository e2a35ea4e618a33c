"""Documents by key in a corpus created from code: put/get/delete, metadata filters inside the FAISS
search (every index type), external embedders recorded by name and dimension."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from cacheblend_rag.corpus import Corpus, ExternalEmbedder, parse_filter
from cacheblend_rag.corpus.manifest import MANIFEST_NAME
from cacheblend_rag.errors import InvalidQueryError, StoreError

TOPICS = {
    "sea": "The ship sailed across the stormy sea towards the harbour at dawn.",
    "cake": "Bake the cake with flour, eggs, butter and sugar for forty minutes.",
    "chess": "The knight moves in an L shape across the chess board.",
}


def bag_of_words(texts: list[str], dim: int = 64) -> list[list[float]]:
    """A small hashing bag-of-words embedder: texts sharing words get similar vectors."""
    out = []
    for text in texts:
        vector = [0.0] * dim
        for word in text.lower().split():
            vector[zlib.crc32(word.strip(".,:;").encode()) % dim] += 1.0
        out.append(vector)
    return out


def words_embedder(name: str = "bag-of-words", dim: int = 64) -> ExternalEmbedder:
    return ExternalEmbedder(name, lambda t: bag_of_words(t, dim), lambda q: bag_of_words([q], dim)[0])


def populate(corpus: Corpus) -> tuple[list[str], list[str], list[dict]]:
    texts, keys, metadatas = [], [], []
    for topic, text in TOPICS.items():
        for i in range(4):
            texts.append(f"{text} Note number {i}.")
            keys.append(f"{topic}-{i}")
            metadatas.append({"topic": topic, "i": i, "even": i % 2 == 0, "tags": [topic, f"n{i}"]})
    corpus.documents.put(texts, keys, metadatas)
    return texts, keys, metadatas


@pytest.fixture(params=["flat", "hnsw", "ivf"])
def corpus(request, tmp_path, model_tokenizer):
    with Corpus.create(
        tmp_path / "c", model_tokenizer, words_embedder(), index_type=request.param
    ) as created:
        yield created


def test_created_from_an_empty_folder_with_the_embedder_recorded(tmp_path, model_tokenizer):
    folder = tmp_path / "empty"
    folder.mkdir()
    Corpus.create(folder, model_tokenizer, words_embedder(dim=48)).close()
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["embedder"] == "external:bag-of-words" and manifest["embedding_dim"] == 48
    with Corpus.open(folder) as opened:
        assert not opened.can_embed
        with pytest.raises(StoreError, match="external embedder external:bag-of-words"):
            opened.documents.search("anything")
    with pytest.raises(StoreError, match="built with embedder external:bag-of-words"):
        Corpus.open(folder, words_embedder("another"))
    with pytest.raises(StoreError, match=r"64-dim vectors.*48-dim"):
        Corpus.open(folder, words_embedder(dim=64))
    with Corpus.open(folder, words_embedder(dim=48)) as opened:
        assert opened.can_embed


def test_put_get_replace_and_delete_by_key(corpus):
    texts, keys, metadatas = populate(corpus)
    got = corpus.documents.get(["cake-1", "missing", "sea-0", "cake-1"])
    assert [(d.key, d.text, d.metadata) for d in got] == [
        ("cake-1", texts[5], metadatas[5]),
        ("sea-0", texts[0], metadatas[0]),
    ]
    assert all(len(d.chunk_ids) == 1 for d in got)  # each fits in one chunk, its text unchanged
    assert corpus.documents.keys_where() == keys
    corpus.documents.put(["A brand new text about chess openings."], ["chess-0"], [{"topic": "chess"}])
    (replaced,) = corpus.documents.get(["chess-0"])
    assert replaced.text.startswith("A brand new") and replaced.metadata == {"topic": "chess"}
    assert corpus.sync_index().ntotal == corpus.db.counts()["chunks"] == len(keys)
    changes = corpus.documents.delete(["sea-0", "sea-1", "unknown"])
    assert changes.removed_documents == 2 and len(changes.removed_chunks) == 2
    assert corpus.sync_index().ntotal == corpus.db.counts()["chunks"] == len(keys) - 2
    assert "sea-0" not in corpus.documents.keys_where()


def test_filters_pick_exactly_the_matching_documents(corpus):
    _, keys, metadatas = populate(corpus)
    cases = [
        ({"topic": "cake"}, lambda m: m["topic"] == "cake"),
        ({"topic": {"$in": ["cake", "chess"]}}, lambda m: m["topic"] in ("cake", "chess")),
        ({"topic": {"$nin": ["cake"]}, "i": {"$gte": 2}}, lambda m: m["topic"] != "cake" and m["i"] >= 2),
        ({"even": True}, lambda m: m["even"]),
        ({"i": {"$ne": 1}}, lambda m: m["i"] != 1),
        ({"tags": {"$contains": "n3"}}, lambda m: m["i"] == 3),
        ({"$or": [{"topic": "sea"}, {"i": 0}]}, lambda m: m["topic"] == "sea" or m["i"] == 0),
        ({"$not": {"topic": "sea"}}, lambda m: m["topic"] != "sea"),
        ({"i": "1"}, lambda m: False),  # a string never equals a number
        ({"missing": {"$ne": 3}}, lambda m: True),  # a document without the key matches $ne
    ]
    for where, expected in cases:
        matching = sorted(k for k, m in zip(keys, metadatas, strict=True) if expected(m))
        found = corpus.documents.search("ship sailed sea harbour", k=len(keys), where=where)
        assert sorted(h.key for h in found) == matching, where
        assert corpus.documents.keys_where(where) == [k for k in keys if k in matching], where


def test_the_filter_is_applied_before_ranking(corpus):
    populate(corpus)
    nearest = corpus.documents.search("ship sailed across the stormy sea", k=4)
    assert {h.key.split("-")[0] for h in nearest} == {"sea"}
    # the 4 nearest are all "sea": filtering them afterwards would return nothing
    cake = corpus.documents.search("ship sailed across the stormy sea", k=4, where={"topic": "cake"})
    assert sorted(h.key for h in cake) == ["cake-0", "cake-1", "cake-2", "cake-3"]
    assert [h.score for h in cake] == sorted((h.score for h in cake), reverse=True)
    vector = np.asarray(bag_of_words(["eggs butter sugar"])[0])
    assert corpus.documents.search(vector, k=1)[0].key.startswith("cake")


def test_a_chunk_shared_by_documents_is_a_hit_for_each_matching_one(corpus):
    corpus.documents.put(["The same words.", "The same words."], ["x", "y"], [{"g": 1}, {"g": 2}])
    assert corpus.db.counts()["chunks"] == 1
    assert sorted(h.key for h in corpus.documents.search("same words", k=5)) == ["x", "y"]
    assert [h.key for h in corpus.documents.search("same words", k=5, where={"g": 2})] == ["y"]
    corpus.documents.delete(["x"])
    assert corpus.db.counts()["chunks"] == 1  # y still holds it
    corpus.documents.delete(["y"])
    assert corpus.db.counts()["chunks"] == 0 and corpus.sync_index().ntotal == 0


def test_bad_input_is_refused_clearly(corpus):
    with pytest.raises(ValueError, match="unknown filter operator 'like'"):
        parse_filter({"topic": {"$like": "s%"}})
    with pytest.raises(ValueError, match=r"\$in on 'topic' takes a list"):
        parse_filter({"topic": {"$in": "sea"}})
    with pytest.raises(ValueError, match="without '\"'"):
        parse_filter({'we"ird': 1})
    with pytest.raises(ValueError, match="a string, number, boolean or null"):
        parse_filter({"topic": {"$eq": {"nested": 1}}})
    with pytest.raises(ValueError, match="cannot be stored as JSON"):
        corpus.documents.put(["text"], ["k"], [{"when": object()}])
    with pytest.raises(InvalidQueryError, match="no text to store"):
        corpus.documents.put([""], ["empty"])
    with pytest.raises(InvalidQueryError, match="k must be"):
        corpus.documents.search("sea", k=0)
    with pytest.raises(StoreError, match="shape"):
        corpus.documents.put(["text"], ["k"], vectors=[[1.0, 2.0]])
