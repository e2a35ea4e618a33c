"""Forged values in the shared remote KV tier (a real Redis): right key, wrong bytes or another model's
value. A node with an empty local KV directory reads the corpus through the tier; ``store verify
--kv-remote`` reports the forged value, the query detects it, recomputes the chunk and answers exactly as
the fault-free run, and the tier is whole again afterwards."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis_support import forge_foreign_fingerprint, forge_layer_bytes, forge_meta_bytes, forge_swapped_value
from reliability_support import answer, invoke_cli

from cacheblend_rag.blend.segments import ChunkKV
from cacheblend_rag.engine import Engine
from cacheblend_rag.rag import CacheBlendRAG
from cacheblend_rag.settings import get_settings
from cacheblend_rag.store.kvstore import KVStore

SWAP_SOURCE = "f" * 64  # forge_swapped_value copies the value stored under this key


@dataclass(frozen=True)
class Forgery:
    name: str
    forge: Callable
    log: str  # what the query must log, with the key
    handling: str
    verify_finds: bool = True  # whether ``store verify`` can tell the value is bad without the query


FORGERIES = [
    Forgery(
        "remote value: a layer's bytes changed",
        forge_layer_bytes,
        "layer 3 checksum mismatch",
        "layer crc fails mid-fusion: deleted, recomputed, fusion retried",
    ),
    Forgery(
        "remote value: metadata bytes changed",
        forge_meta_bytes,
        "metadata checksum mismatch",
        "metadata crc fails: deleted, logged miss, recomputed",
    ),
    Forgery(
        "remote value of another model (fingerprint)",
        forge_foreign_fingerprint,
        "foreign value of model",
        "fingerprint differs: never used, deleted, recomputed",
        # a tier may hold several models' chunks, and a key does not reveal its model: verify finds the
        # value self-consistent; only the node that expects this key's model can refuse it
        verify_finds=False,
    ),
    Forgery(
        "another chunk's valid value under this key",
        forge_swapped_value,
        "not the key it is stored under",
        "key in metadata differs: never used, deleted, recomputed",
    ),
]


@contextmanager
def node(corpus_dir: Path, model, url: str):
    """A CacheBlendRAG over ``corpus_dir`` whose KV store has the remote tier at ``url``."""
    store = KVStore(corpus_dir / "kv", model.fingerprint, model.shape, remote=url)
    try:
        yield CacheBlendRAG(corpus_dir, engine=Engine(model, store=store))
    finally:
        store.close()


@pytest.fixture
def verify_remote(monkeypatch):
    """``verify_remote(corpus_dir, url) -> (exit code, report)``: ``store verify --kv-remote --json`` in this
    process (``--kv-remote`` overrides the setting for that command only)."""
    monkeypatch.delenv("CACHEBLEND_KV_REMOTE", raising=False)  # from here on restored at teardown

    def run(corpus_dir: Path, url: str) -> tuple[int, dict]:
        result = invoke_cli("store", "verify", "--corpus", corpus_dir, "--kv-remote", url, "--json")
        return result.exit_code, json.loads(result.output)

    yield run
    monkeypatch.undo()
    get_settings.cache_clear()


@pytest.mark.parametrize("forgery", FORGERIES, ids=[f.forge.__name__ for f in FORGERIES])
def test_forged_remote_value_is_detected_and_recomputed(
    forgery, store_copy, model, reference, rel_questions, redis_server, verify_remote, faults, caplog
):
    question = rel_questions[FORGERIES.index(forgery) % len(rel_questions)]
    want = reference.answers([(question, "cacheblend")])
    key, other = reference.kv_keys(question)[:2]
    url = redis_server.url
    publisher = store_copy("publisher")  # the node that ingested: its whole corpus pinned in the tier
    with KVStore.open_existing(publisher / "kv", remote=url) as kv:
        keys = [
            p.name.removesuffix(".safetensors") for p in (publisher / "kv" / "chunks").rglob("*.safetensors")
        ]
        assert all(kv.pin(k) for k in keys)
        if forgery.forge is forge_swapped_value:  # a valid value of this model, of another chunk
            source = kv.get(other)
            kv.remote.put(SWAP_SOURCE, _materialise(source), pinned=True)
        tier = kv.remote
        client = redis_server.client()
        meta = json.loads(client.hget(tier.name_for(key), "meta"))
        forgery.forge(client, tier.name_for(key), meta)

    code, report = verify_remote(publisher, url)
    found = [bad["key"] for bad in report["remote"]["corrupt"]]
    assert (code, found) == ((1, [key]) if forgery.verify_finds else (0, [])), report["remote"]
    assert report["ok"] == len(keys)  # the publisher's own files are untouched

    reader = publisher.parent / "reader"  # same corpus, empty local KV directory
    shutil.copytree(publisher, reader, ignore=shutil.ignore_patterns("kv", "*-shm", "*.lock"))
    caplog.set_level(logging.WARNING, logger="cacheblend_rag")
    with node(reader, model, url) as rag:
        got = {(question, "cacheblend"): answer(rag, question)}
        counters = rag.engine.store.remote.counters
        assert counters.corrupt == 1 and counters.hits >= 1  # the other chunk still came from the tier
    logged = [r.getMessage() for r in caplog.records if key[:16] in r.getMessage()]
    assert any(forgery.log in message for message in logged), caplog.text
    assert not faults.record("remote", forgery.name, forgery.handling, got, want)

    # the recomputed chunk was written back: the tier (and both local stores) verify clean
    client.delete(tier.name_for(SWAP_SOURCE))
    for corpus_dir in (publisher, reader):
        code, report = verify_remote(corpus_dir, url)
        assert code == 0 and report["clean"], report
    assert json.loads(client.hget(tier.name_for(key), "meta"))["model_fingerprint"] == model.fingerprint


def _materialise(source) -> ChunkKV:
    """A chunk's KV source read into memory."""
    layers = [source.layer(i) for i in range(source.num_layers)]
    return ChunkKV([k for k, _ in layers], [v for _, v in layers], source.fingerprint)
