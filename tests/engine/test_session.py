"""Session: a corpus and its engine, checked once to belong together, held by CacheBlendRAG."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cacheblend_rag.blend.segments import NO_CONTEXT
from cacheblend_rag.corpus.corpus import Corpus
from cacheblend_rag.engine import Engine, SamplingParams
from cacheblend_rag.engine.session import Session
from cacheblend_rag.errors import StoreError
from cacheblend_rag.ingest.pipeline import ingest
from cacheblend_rag.models.shared import shared_models
from cacheblend_rag.rag import CacheBlendRAG
from cacheblend_rag.settings import get_settings
from cacheblend_rag.store.shared import KVStoreOptions

CORPUS_FILE = Path(__file__).parents[2] / "examples" / "data" / "corpus" / "musique_case005.md"


def test_rag_over_a_session_holds_it_and_leaves_it_to_its_holder(rag_store, sample_questions):
    settings = get_settings()
    corpus = Corpus.open(rag_store, kv_options=KVStoreOptions.of(settings))
    before = sum(shared_models().values())
    session = Session.open(corpus, "torch", config=settings, owns_corpus=True)
    try:
        engine = session.engine
        assert engine.store is corpus.kv_store and engine.chunk_context == corpus.chunk_context
        assert sum(shared_models().values()) == before + 1, "the session's engine holds the model"
        rag = CacheBlendRAG(session, config=settings)
        assert rag.session is session and rag.corpus is corpus and rag.engine is session.engine
        result = rag.query(sample_questions[0]["question"], sampling=SamplingParams(4))
        assert result.chunk_ids and result.prompt_tokens > 0
        rag.close()
        assert sum(shared_models().values()) == before + 1, "a session given stays its holder's"
        with pytest.raises(ValueError, match="a session brings its engine"):
            CacheBlendRAG(session, engine="torch", config=settings)
    finally:
        session.close()
    assert sum(shared_models().values()) == before


def test_an_engine_of_another_chunk_context_is_refused_by_the_session_and_by_ingest(
    rag_store, model, tmp_path
):
    with Corpus.open(rag_store) as corpus:
        alone = Engine(model, store=corpus.kv_store, chunk_context=NO_CONTEXT)
        with pytest.raises(StoreError, match=re.escape(f"corpus {rag_store} precomputes chunk KV behind a")):
            Session(corpus, alone)
        with pytest.raises(StoreError, match="chunk context"):
            CacheBlendRAG(corpus, engine=alone, config=get_settings())
        # the same check, before ingest writes anything: a new corpus is cut behind the neutral context
        with pytest.raises(StoreError, match="0-token one; create the engine with chunk_context="):
            ingest([CORPUS_FILE], tmp_path / "new", engine=alone, config=get_settings())
    assert not (tmp_path / "new").exists()


def test_a_session_opens_a_corpus_directory_and_closes_what_it_opened(rag_store):
    before = sum(shared_models().values())
    session = Session.open(rag_store, "torch", config=get_settings())
    try:
        assert Path(session.corpus.corpus_dir).resolve() == Path(rag_store).resolve()
        assert session.engine.store is session.corpus.kv_store
        assert sum(shared_models().values()) == before + 1
    finally:
        session.close()
    assert sum(shared_models().values()) == before
