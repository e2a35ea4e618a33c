"""Recognising stored chunks in prompt text (cacheblend_rag.frontend.ChunkTextIndex): no model needed."""

from __future__ import annotations

import shutil
import time

import pytest

from cacheblend_rag.corpus.corpus import Corpus
from cacheblend_rag.frontend import ANCHOR_CHARS, ChunkTextIndex, chunk_forms, get_corpus


@pytest.fixture(scope="module")
def corpus(sample_store) -> Corpus:
    return get_corpus(sample_store)


@pytest.fixture(scope="module")
def chunks(corpus):
    ids = list(corpus.db.iter_chunk_ids())
    return corpus.get_chunks(ids[:3])


def test_finds_chunks_whatever_surrounds_them(corpus, chunks):
    a, b, c = chunks
    parts = ["<|im_start|>user\nContext:\n", a.text, "\n---\n[2] ", b.text, c.text, "\n\nQuestion: why?"]
    text = "".join(parts)
    spans = ChunkTextIndex(corpus).find(text)
    assert [s.chunk_id for s in spans] == [a.chunk_id, b.chunk_id, c.chunk_id]
    for span, chunk in zip(spans, chunks, strict=True):
        assert text[span.start : span.end] == chunk.text
        assert span.token_ids == chunk.token_ids  # the stored ids, not a re-tokenization


def test_altered_or_partial_text_is_not_taken_for_a_chunk(corpus, chunks):
    a = chunks[0].text
    middle = len(a) // 2
    altered = [a[:-1], a[1:], a.upper(), a[:middle] + "#" + a[middle + 1 :], a[: ANCHOR_CHARS + 5]]
    index = ChunkTextIndex(corpus)
    for text in altered:
        assert [s for s in index.find(f"before {text} after") if s.chunk_id == chunks[0].chunk_id] == []


def test_recognises_the_forms_frameworks_paste(corpus, chunks):
    """LlamaIndex's compact synthesizers strip chunk texts; its SimpleSummarize pastes str(list)."""
    index = ChunkTextIndex(corpus)
    a, b = chunks[0], next(c for c in chunks if c.text != c.text.strip())
    stripped = f"Context:\n{b.text.strip()}\n\nQuestion"
    as_list = f"Context: {[a.text + chr(10) + b.text]}\nQuestion"  # one string: the chunks joined by "\n"
    for text, first in ((stripped, b), (as_list, a)):
        spans = index.find(text)
        assert [s.chunk_id for s in spans][:1] == [first.chunk_id], text[:80]
        found = text[spans[0].start : spans[0].end]
        assert found != first.text and found in chunk_forms(first.text).values()
        assert spans[0].token_ids == tuple(corpus.chunker.tokenize(found))
    assert [s.chunk_id for s in index.find(as_list)] == [a.chunk_id, b.chunk_id]


def test_follows_chunks_added_to_the_store(sample_store, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(sample_store, store)
    corpus = Corpus.open(store)
    index = ChunkTextIndex(corpus)
    new = "The lighthouse of Varnholm was kept for ninety years by three generations of one family."
    prompt = f"Context:\n{new}\n\nQuestion: who kept it?"
    assert index.find(prompt) == []
    (ids,) = corpus.add_texts([new])
    spans = index.find(prompt)
    assert [s.chunk_id for s in spans] == ids
    assert prompt[spans[0].start : spans[0].end] == new
    corpus.close()


def test_search_cost_is_linear_in_the_prompt(corpus, chunks):
    index = ChunkTextIndex(corpus)
    index.find("warm up the anchor table " * 4)
    filler = "lorem ipsum dolor sit amet, " * 1500  # 42,000 characters without any chunk
    started = time.perf_counter()
    spans = index.find(filler + chunks[0].text + filler)
    elapsed = time.perf_counter() - started
    assert [s.chunk_id for s in spans] == [chunks[0].chunk_id]
    assert elapsed < 2.0, f"{elapsed:.2f} s to scan {len(filler) * 2} characters"
