"""The process-wide corpora: one opened corpus per directory, held by reference count; the last holder
that closes closes it (its database), and one a retriever read stays open for the process."""

from __future__ import annotations

from cacheblend_rag.frontend import (
    DocumentCollection,
    PromptFrontend,
    acquire_corpus,
    get_corpus,
    release_corpus,
    shared_corpora,
)
from cacheblend_rag.frontend.corpora import corpus_key
from cacheblend_rag.settings import get_settings

QUESTION = "Who wrote The Lamp Room?"


def test_the_last_release_closes_the_corpus(rag_store):
    settings = get_settings()
    key = corpus_key(rag_store)
    first = acquire_corpus(rag_store, config=settings)
    second = acquire_corpus(rag_store / ".", config=settings)  # another spelling of the same folder
    assert second is first and shared_corpora()[key] == 2
    release_corpus(first)
    assert not first.db.closed and first.search(QUESTION, 1), "one holder left: still open and read"
    release_corpus(second)
    assert first.db.closed and key not in shared_corpora()
    again = acquire_corpus(rag_store, config=settings)
    try:
        assert again is not first and again.search(QUESTION, 1), "the next holder opens it again"
    finally:
        release_corpus(again)


def test_a_closed_frontend_that_held_the_corpus_last_closes_it(rag_store):
    frontend = PromptFrontend(rag_store, config=get_settings())
    corpus = frontend.corpus
    assert corpus is not None and shared_corpora()[corpus_key(rag_store)] == 1
    frontend.close()
    assert corpus.db.closed and corpus_key(rag_store) not in shared_corpora()


def test_a_corpus_a_retriever_read_outlives_the_collection(rag_store):
    settings = get_settings()
    collection = DocumentCollection(rag_store, config=settings)
    read = get_corpus(rag_store, config=settings)  # what a retriever does; it has nothing to close
    assert read is collection.corpus and get_corpus(rag_store, config=settings) is read
    assert shared_corpora()[corpus_key(rag_store)] == 2, "the process holds it once, however often read"
    collection.close()
    collection.close()  # twice is once
    assert not read.db.closed and read.search(QUESTION, 1)
