"""Eval retrieves through the product's corpus (a data set's contexts stored as documents, searched with a
metadata filter): the chunks it retrieves are the ones the plain top-k of the question's cosine over the
case's own chunks gives, so eval numbers measured before the move stand."""

from __future__ import annotations

import numpy as np
import pytest

from cacheblend_rag.eval.datasets import load_dataset, select_cases
from cacheblend_rag.eval.retrieval import EvalCorpus
from cacheblend_rag.store.kvstore import KVStore
from cacheblend_rag.text.chunker import Chunker


def plain_top_k(case, chunker, embedder, top_k):
    """The chunks of ``case`` (context, chunk, tokens) ranked by cosine to its question, best first."""
    pieces = [
        (i, j, chunk.token_ids, chunk.text)
        for i, context in enumerate(case.contexts)
        for j, chunk in enumerate(chunker.split(context.document))
    ]
    scores = embedder.embed([p[3] for p in pieces]) @ embedder.embed_query(case.question)
    order = np.argsort(-scores, kind="stable")[:top_k]
    return [pieces[k][:3] for k in order], len(pieces)


@pytest.mark.parametrize("chunk_tokens", [512, 128])
def test_corpus_retrieval_is_the_cosine_top_k_of_the_case(
    tmp_path, model, model_tokenizer, embedder, chunk_tokens
):
    store = KVStore(tmp_path / "kv", model.fingerprint, model.shape, "int8")
    cases = select_cases(load_dataset("musique").cases, 6, seed=0)
    chunker = Chunker(model_tokenizer.tokenizer, chunk_tokens)
    with EvalCorpus.open(
        tmp_path / "corpus", model_tokenizer, embedder, chunk_tokens, store, "neutral"
    ) as corpus:
        for case in cases:
            got, total = corpus.retrieve(case, 6, "qa")
            expected, expected_total = plain_top_k(case, chunker, embedder, 6)
            assert total == expected_total
            assert [(c.context, c.chunk, c.token_ids) for c in got] == expected
            assert all(c.chunk_id for c in got) and all(-1 <= c.score <= 1 for c in got)
            # a chunk of another case (all share one corpus) would have changed the list above
        stored = corpus.corpus.documents.keys_where({"case": cases[0].case_id})
        assert len(stored) == len(cases[0].contexts)
    # reopening finds the stored documents: nothing is added twice
    with EvalCorpus.open(
        tmp_path / "corpus", model_tokenizer, embedder, chunk_tokens, store, "neutral"
    ) as corpus:
        before = corpus.corpus.stats()
        corpus.retrieve(cases[0], 6, "qa")
        assert corpus.corpus.stats() == before


def test_summaries_take_the_first_chunks_in_document_order(tmp_path, model, model_tokenizer, embedder):
    store = KVStore(tmp_path / "kv", model.fingerprint, model.shape, "int8")
    case = load_dataset("multinews").cases[0]
    chunker = Chunker(model_tokenizer.tokenizer, 128)
    pieces = [
        (i, j, chunk.token_ids)
        for i, context in enumerate(case.contexts)
        for j, chunk in enumerate(chunker.split(context.document))
    ]
    with EvalCorpus.open(tmp_path / "corpus", model_tokenizer, embedder, 128, store, "neutral") as corpus:
        got, total = corpus.retrieve(case, 5, "summary")
    assert total == len(pieces)
    assert [(c.context, c.chunk, c.token_ids) for c in got] == pieces[:5]
    assert all(c.score is None for c in got)


def test_multinews_at_128_tokens_keeps_every_article_in_short_chunks(
    tmp_path, model, model_tokenizer, embedder
):
    """``make eval-short``'s set (--data multinews --chunk-tokens 128): each article of a held-out case cut
    into chunks of at most 128 tokens that together are the article's tokens, the prompt the first top-k of
    them in document order (at most 24 * 128 = 3,072 tokens, as 6 chunks of 512)."""
    store = KVStore(tmp_path / "kv", model.fingerprint, model.shape, "int8")
    tokenize = model_tokenizer.tokenizer
    with EvalCorpus.open(tmp_path / "corpus", model_tokenizer, embedder, 128, store, "neutral") as corpus:
        for case in select_cases(load_dataset("multinews").cases, 4, seed=0):
            every, total = corpus.retrieve(case, 10_000, "summary")
            assert len(every) == total > 1 and all(0 < len(c.token_ids) <= 128 for c in every)
            assert [(c.context, c.chunk) for c in every] == sorted((c.context, c.chunk) for c in every)
            for i, context in enumerate(case.contexts):
                article = tokenize(context.document, add_special_tokens=False)["input_ids"]
                assert sum((c.token_ids for c in every if c.context == i), ()) == tuple(article)
            for top_k in (6, 24):
                prompt, _ = corpus.retrieve(case, top_k, "summary")
                assert prompt == every[:top_k] and sum(len(c.token_ids) for c in prompt) <= top_k * 128
