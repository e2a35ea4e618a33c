"""Chunks precomputed behind a chunk context: the stored layout, the key, the engine and old corpora."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict, replace

import pytest
import torch

from cacheblend_rag.blend import CacheBlend, FullRecompute, Fusor
from cacheblend_rag.blend.segments import NO_CONTEXT, ChunkContext, prefill_chunk_kv
from cacheblend_rag.corpus.chunkdb import DB_NAME, FORMAT_VERSION, MANIFEST_NAME, CorpusManifest
from cacheblend_rag.corpus.corpus import Corpus
from cacheblend_rag.corpus.manifest import format_for
from cacheblend_rag.engine import ChunkRef, Engine
from cacheblend_rag.errors import StoreError
from cacheblend_rag.ingest.pipeline import ingest
from cacheblend_rag.models.tokenizer import chunk_context_ids
from cacheblend_rag.rag import CacheBlendRAG
from cacheblend_rag.store.kvstore import KVStore

TEXT = "The Danube flows through ten countries before it reaches the Black Sea in Romania and Ukraine."


@pytest.fixture(scope="module")
def neutral(model) -> ChunkContext:
    return ChunkContext(chunk_context_ids(model.tokenizer, "neutral"))


def test_neutral_context_is_the_chat_templates_opening(model, neutral):
    text = model.tokenizer.decode(neutral.token_ids)
    assert text == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    assert chunk_context_ids(model.tokenizer, "none") == ()
    with pytest.raises(ValueError, match="unknown chunk context 'bos'"):
        chunk_context_ids(model.tokenizer, "bos")


def test_kv_behind_a_context_is_the_joint_prefill_rotated_back(model, neutral):
    ids = model.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    p, n = len(neutral), len(ids)
    kv = prefill_chunk_kv(model, ids, neutral)
    _, joint = model.prefill(list(neutral.token_ids) + ids)
    here = torch.arange(p, p + n)
    for layer in (0, 7, model.num_layers - 1):
        keys, values = kv.layer(layer)
        assert keys.shape == (model.shape.num_kv_heads, n, model.shape.head_dim)
        # (float32 rounding: the chunk's rows go through the GEMMs as n rows, the joint prefill's as p + n,
        # and oneDNN's kernel may sum in another order for another row count, models/gemm.py)
        assert torch.allclose(values, joint.values[layer][0, :, p:], atol=1e-4)
        # rotating the stored keys back to where they were computed gives the joint prefill's keys
        back = model.rope.rerotate(keys, here - p, here)
        assert torch.allclose(back, joint.keys[layer][0, :, p:], atol=1e-4)
    # the chunk's own first token is no attention sink any more: its K differs from the alone prefill
    alone = prefill_chunk_kv(model, ids, NO_CONTEXT)
    assert not torch.allclose(alone.layer(5)[0][:, 0], kv.layer(5)[0][:, 0], atol=1e-2)


def test_context_is_part_of_the_key_and_fusion_stays_exact(model, neutral, tmp_path):
    store = KVStore(tmp_path / "kv", model.fingerprint, model.shape, torch.float32)
    engine = Engine(model, store=store, chunk_context=neutral)
    ids = tuple(model.tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    assert engine.chunk_key(ids) == store.chunk_key(ids, neutral.key) != store.chunk_key(ids)
    engine.ensure_chunk_kv(ids)
    assert store.contains(engine.chunk_key(ids)) and not store.contains(store.chunk_key(ids))
    # a prefix_cache prefix is the prompt's own head: prefilled alone, keyed without a context
    segments = engine.rag_segments("Where does the Danube end?", [ChunkRef(ids)], "prefix_cache")
    assert store.contains(store.chunk_key(segments[0].token_ids))
    # r = 1 recomputes everything: equal to full prefill whatever the chunk KV was computed behind
    segments = engine.rag_segments("Where does the Danube end?", [ChunkRef(ids)], "cacheblend")
    reference = Fusor(model).fuse(segments, FullRecompute()).logits
    fused = Fusor(model).fuse(segments, CacheBlend(ratio=1.0)).logits
    assert (fused - reference).abs().max().item() <= 1e-4
    # and the reused KV is the context's: full reuse of the chunk differs from a chunk prefilled alone
    alone = Engine(model, store=store, chunk_context=NO_CONTEXT)
    assert alone.chunk_key(ids) != engine.chunk_key(ids)
    engine.store.close()


def test_new_corpus_records_its_context_and_old_ones_are_upgraded(model, embedder, neutral, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(TEXT)
    corpus_dir = tmp_path / "corpus"
    engine = Engine(model, store=corpus_dir / "kv", chunk_context=neutral)
    ingest([docs], corpus_dir, engine=engine)
    manifest = CorpusManifest.load(corpus_dir)
    # format 2, or 3 for a quantized codec (the default int8)
    assert manifest.format_version == format_for(manifest.kv_dtype) >= FORMAT_VERSION
    assert manifest.chunk_context == neutral.token_ids
    with sqlite3.connect(corpus_dir / DB_NAME) as db:
        ((key, ready),) = db.execute("SELECT kv_key, kv_ready FROM chunks").fetchall()
    assert ready == 1 and engine.store.contains(key)

    # make it look like a corpus of format 1: chunk KV computed alone, keys without a context
    alone = Engine(model, store=corpus_dir / "kv", chunk_context=NO_CONTEXT)
    with Corpus.open(corpus_dir) as corpus:
        chunk_ids = tuple(corpus.get_chunks([_only_chunk(corpus_dir)])[0].token_ids)
    alone.ensure_chunk_kv(chunk_ids)
    old_key = alone.chunk_key(chunk_ids)
    with sqlite3.connect(corpus_dir / DB_NAME) as db:
        db.execute("UPDATE chunks SET kv_key = ?", (old_key,))
    old = asdict(replace(manifest, format_version=1))
    del old["chunk_context"]
    (corpus_dir / MANIFEST_NAME).write_text(json.dumps(old))

    # read as it was built (no context), so an engine with the neutral context is refused
    with Corpus.open(corpus_dir) as corpus:
        assert corpus.chunk_context == NO_CONTEXT
    with pytest.raises(StoreError, match="chunk context"):
        CacheBlendRAG(corpus_dir, engine=engine)
    # ingest upgrades it: the neutral context recorded, the KV recomputed, the stale KV dropped
    ingest([docs], corpus_dir, engine=engine)
    upgraded = CorpusManifest.load(corpus_dir)
    assert upgraded.format_version == format_for(upgraded.kv_dtype) >= FORMAT_VERSION
    assert upgraded.chunk_context == neutral.token_ids
    with sqlite3.connect(corpus_dir / DB_NAME) as db:
        ((key, ready),) = db.execute("SELECT kv_key, kv_ready FROM chunks").fetchall()
    assert ready == 1 and key == engine.chunk_key(chunk_ids)
    assert engine.store.contains(key) and not engine.store.contains(old_key)
    rag = CacheBlendRAG(corpus_dir, engine=engine)
    assert rag.query("Where does the Danube end?").reused_tokens > 0
    engine.store.close()


def _only_chunk(corpus_dir) -> str:
    with sqlite3.connect(corpus_dir / DB_NAME) as db:
        return db.execute("SELECT chunk_id FROM chunks").fetchone()[0]


def test_segments_from_two_contexts_never_mix(model, neutral, tmp_path):
    """A store shared by engines of different contexts serves each its own KV."""
    store = KVStore(tmp_path / "kv", model.fingerprint, model.shape, torch.float32)
    ids = tuple(model.tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    with_context = Engine(model, store=store, chunk_context=neutral).chunk_kv(ids)
    alone = Engine(model, store=store, chunk_context=NO_CONTEXT).chunk_kv(ids)
    assert not torch.equal(with_context.layer(3)[1], alone.layer(3)[1])
    store.close()
