"""The shared remote KV tier on a real Redis server: round trips, read-through from a second node, forged
values, outages, pinned vs evictable chunks, verify and gc."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch
from redis_support import (
    forge_foreign_fingerprint,
    forge_layer_bytes,
    forge_meta_bytes,
    forge_swapped_value,
)
from store_support import FINGERPRINT

from cacheblend_rag.blend.spec import choose_ratio
from cacheblend_rag.engine import ChunkRef, Engine, SamplingParams
from cacheblend_rag.errors import CorruptKVError, RemoteKVUnavailableError, StoreError
from cacheblend_rag.settings import get_settings
from cacheblend_rag.store.fileformat import build_metadata, metadata_crc
from cacheblend_rag.store.keys import chunk_key
from cacheblend_rag.store.kvstore import KVStore, tier_of
from cacheblend_rag.store.remote import RedisKVTier, RemoteChunkKV
from cacheblend_rag.store.shared import KVStoreOptions

DATA_DIR = Path(__file__).parents[1] / "data"
REMOTE_LOGGER = "cacheblend_rag.store.remote"
SAMPLING = SamplingParams(max_tokens=12)
RATIO = 0.15  # fixed, so two nodes answer alike whatever tier the controller would see


def remote_warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == REMOTE_LOGGER and r.levelno >= logging.WARNING
    ]


def assert_same_layers(source, kv, dtype=torch.float16) -> None:
    assert (source.num_layers, source.num_tokens) == (kv.num_layers, kv.num_tokens)
    for i in range(kv.num_layers):
        k, v = source.layer(i)
        assert k.dtype == v.dtype == dtype
        assert torch.equal(k, kv.keys[i].to(dtype)) and torch.equal(v, kv.values[i].to(dtype))


def read_all(source) -> None:
    for i in range(source.num_layers):
        source.layer(i)


@pytest.fixture(scope="module")
def rag_case(model) -> tuple[str, list[ChunkRef]]:
    """A real MuSiQue question with two of its paragraphs, cut to 96 tokens each."""
    case = json.loads((DATA_DIR / "musique_case0.json").read_text())
    tok = model.tokenizer
    refs = [
        ChunkRef(tuple(tok(p, add_special_tokens=False)["input_ids"][:96]), f"p{i}")
        for i, p in enumerate(case["paragraphs"][:2])
    ]
    return case["question"], refs


def node(model, root: Path, url: str) -> Engine:
    """One 'node': an engine on the shared model with its own local store directory and the remote tier."""
    return Engine(model=model, store=KVStore(root, model.fingerprint, model.shape, "float16", remote=url))


def answer(engine: Engine, question: str, refs: list[ChunkRef]) -> str:
    segments = engine.rag_segments(question, refs, "cacheblend")
    return engine.generate(segments, "cacheblend", SAMPLING, ratio=RATIO).text


# -- round trips ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_round_trip_is_bit_exact_per_layer(redis_server, model, real_chunks, kv_dtype):
    ids, kv = real_chunks[0]
    tier = RedisKVTier(redis_server.url, model.fingerprint, model.shape, kv_dtype)
    key = chunk_key(model.fingerprint, kv_dtype, ids)
    written = tier.put(key, kv)
    assert written > kv.to(kv_dtype).nbytes  # every layer's bytes plus the metadata
    assert tier.put(key, kv) == 0  # already there: nothing rewritten
    assert tier.get(chunk_key(model.fingerprint, kv_dtype, real_chunks[1][0])) is None

    fresh = RedisKVTier(redis_server.url, model.fingerprint, model.shape, kv_dtype, local_cache_bytes=0)
    source = fresh.get(key)
    assert isinstance(source, RemoteChunkKV) and tier_of(source) == "remote"
    assert_same_layers(source, kv, kv_dtype)
    assert fresh.counters.layer_reads == model.shape.num_layers
    assert fresh.counters.bytes_read == kv.to(kv_dtype).nbytes

    cached = RedisKVTier(redis_server.url, model.fingerprint, model.shape, kv_dtype)
    for _ in range(2):  # the second pass is served by the local LRU in front of the server
        assert_same_layers(cached.get(key), kv, kv_dtype)
    assert cached.counters.layer_reads == model.shape.num_layers
    assert cached.counters.cache_hits == model.shape.num_layers


def test_second_node_reads_through_without_recomputing(tmp_path, redis_server, model, rag_case):
    question, refs = rag_case
    node_a = node(model, tmp_path / "a", redis_server.url)
    for ref in refs:  # what ingest does: precompute and store, written through as pinned corpus KV
        assert node_a.ensure_chunk_kv(ref.token_ids) > 0
    answer_a = answer(node_a, question, refs)

    node_b = node(model, tmp_path / "b", redis_server.url)  # empty local directory
    assert node_b.store.stats()["disk"]["entries"] == 0
    sources = [node_b.chunk_kv(ref.token_ids) for ref in refs]
    # chunk_kv computes only on a miss; these came from the remote tier, so nothing was recomputed
    assert all(isinstance(s, RemoteChunkKV) for s in sources)
    assert node_b.store.counters.puts == 0
    with_sources = [ChunkRef(r.token_ids, r.chunk_id, s) for r, s in zip(refs, sources, strict=True)]
    # the loading controller profiles RAM and disk: a chunk from the remote tier counts as a disk load
    segments = node_b.rag_segments(question, with_sources, "cacheblend")
    assert [tier_of(s.kv) for s in segments if s.kv is not None and not s.exact] == ["remote", "remote"]
    assert choose_ratio(node_b.controller, segments).tier == "disk"
    answer_b = answer(node_b, question, with_sources)
    assert answer_b == answer_a and answer_b.strip()
    remote = node_b.store.remote.counters
    assert remote.hits == len(refs) and remote.layer_reads == len(refs) * model.shape.num_layers

    # every layer was read: the chunks are now in B's RAM and, once written, on its local disk
    node_b.store.flush()
    for ref in refs:
        key = node_b.chunk_key(ref.token_ids)
        assert tier_of(node_b.store.get(key)) == "ram" and node_b.store.path_for(key).is_file()
    assert node_b.store.verify().clean and node_a.store.verify().clean
    node_b.store.evict_ram()
    assert answer(node_b, question, refs) == answer_a  # now from B's own disk


def test_ingest_pins_what_is_stored_anywhere_and_recomputes_nothing(tmp_path, redis_server, model, rag_case):
    """Ingest (ensure_chunk_kv) on several nodes: a chunk on a node's local disk only is pushed to the
    server as corpus KV, a request's copy there (with a TTL) is made permanent, and a node with an empty
    local store computes nothing the server already holds."""
    _, refs = rag_case
    client = redis_server.client()
    local_only = Engine(
        model=model, store=KVStore(tmp_path / "a", model.fingerprint, model.shape, "float16", remote="")
    )
    assert local_only.ensure_chunk_kv(refs[0].token_ids) > 0  # before the shared tier was configured
    local_only.store.close()

    node_a = node(model, tmp_path / "a", redis_server.url)  # the same local directory, now with the tier
    key_0, key_1 = (node_a.chunk_key(ref.token_ids) for ref in refs)
    assert not node_a.store.remote.contains(key_0)
    assert node_a.ensure_chunk_kv(refs[0].token_ids) == 0  # present locally: not recomputed...
    assert client.ttl(node_a.store.remote.name_for(key_0)) == -1  # ...but pushed, pinned
    assert node_a.store.counters.puts == 0
    assert node_a.store.pin(key_0) and not node_a.store.pin(key_1)  # key_1: held by no tier yet

    request = node(model, tmp_path / "r", redis_server.url)
    request.chunk_kv(refs[1].token_ids)  # computed for a request: request traffic, with a TTL
    assert 0 < client.ttl(request.store.remote.name_for(key_1)) <= request.store.remote.adhoc_ttl_s
    request.store.put_async(request.store.chunk_key([7, 8, 9]), request.precompute([7, 8, 9])).result()
    assert client.ttl(request.store.remote.name_for(request.store.chunk_key([7, 8, 9]))) > 0

    node_b = node(model, tmp_path / "b", redis_server.url)  # empty local directory
    assert all(node_b.store.contains(key) for key in (key_0, key_1))  # the server holds them
    assert not node_b.store.contains(key_0, remote=False)
    assert [node_b.ensure_chunk_kv(ref.token_ids) for ref in refs] == [0, 0]
    assert node_b.store.counters.puts == 0 and node_b.store.stats()["disk"]["entries"] == 0
    assert client.ttl(node_b.store.remote.name_for(key_1)) == -1  # the request's copy is corpus now
    assert node_b.store.remote.verify().clean
    for engine in (node_a, request, node_b):
        engine.close()


def test_setting_kv_remote_wires_every_store(tmp_path, redis_server, model, real_chunks, monkeypatch):
    """The setting reaches every store opened with the settings' options (what the edges pass down); a
    store opened without them reads no environment: it has no remote tier."""
    ids, kv = real_chunks[0]
    monkeypatch.setenv("CACHEBLEND_KV_REMOTE", redis_server.url)
    get_settings.cache_clear()
    try:
        options = KVStoreOptions.of(get_settings()).store_kwargs()
        a = KVStore(tmp_path / "a", model.fingerprint, model.shape, "float16", **options)
        b = KVStore(tmp_path / "b", model.fingerprint, model.shape, "float16", **options)
        off = KVStore(tmp_path / "c", model.fingerprint, model.shape, "float16")
    finally:
        get_settings.cache_clear()
    assert off.remote is None and a.remote is not None
    key = a.chunk_key(ids)
    a.put(key, kv)
    assert b.stats()["remote"]["url"] == redis_server.url
    assert_same_layers(b.get(key), kv)
    assert off.get(key) is None
    assert a.delete(key)  # delete reaches the remote tier too: no orphan KV there
    b.evict_ram()
    b.delete(key)
    assert b.get(key) is None and not redis_server.client().keys("cacheblend:kv:*")
    for store in (a, b, off):
        store.close()


# -- integrity -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("forge", "message"),
    [
        (forge_layer_bytes, "layer 3 checksum mismatch"),
        (forge_meta_bytes, "metadata checksum mismatch"),
        (forge_foreign_fingerprint, "foreign value of model"),
        (forge_swapped_value, "not the key it is stored under"),
    ],
    ids=["layer-bytes", "meta-bytes", "foreign-fingerprint", "swapped"],
)
def test_forged_value_is_a_miss_and_is_recomputed(
    tmp_path, redis_server, model, rag_case, caplog, forge, message
):
    question, refs = rag_case
    node_a = node(model, tmp_path / "a", redis_server.url)
    for ref in refs:
        node_a.ensure_chunk_kv(ref.token_ids)
    reference = answer(node_a, question, refs)
    key = node_a.chunk_key(refs[0].token_ids)
    tier = node_a.store.remote
    client = redis_server.client()
    if forge is forge_swapped_value:  # the other chunk: a valid value of this model under another key
        tier.put("f" * 64, node_a.precompute(refs[1].token_ids))
    meta = json.loads(client.hget(tier.name_for(key), "meta"))
    forge(client, tier.name_for(key), meta)

    node_b = node(model, tmp_path / "b", redis_server.url)
    with caplog.at_level(logging.WARNING):
        assert answer(node_b, question, refs) == reference  # the forged chunk was recomputed
    assert any(message in text and key[:16] in text for text in remote_warnings(caplog))
    assert node_b.store.remote.counters.corrupt == 1
    # the recomputed chunk was written back (as request traffic): the tier is whole again
    assert json.loads(client.hget(tier.name_for(key), "meta"))["model_fingerprint"] == model.fingerprint
    report = tier.verify()
    assert report.clean and report.corrupt == [], report.as_dict()


# -- outages -------------------------------------------------------------------------------------------


def test_killed_server_costs_a_recompute_and_one_warning(tmp_path, redis_server, model, rag_case, caplog):
    question, refs = rag_case
    node_a = node(model, tmp_path / "a", redis_server.url)
    for ref in refs:
        node_a.ensure_chunk_kv(ref.token_ids)
    reference = answer(node_a, question, refs)
    node_b = node(model, tmp_path / "b", redis_server.url)
    half_read = node_b.store.get(node_b.chunk_key(refs[0].token_ids))
    half_read.layer(0)

    redis_server.kill()
    with caplog.at_level(logging.WARNING):
        with pytest.raises(RemoteKVUnavailableError):  # a CorruptKVError: the engine recomputes
            half_read.layer(1)
        del half_read
        for _ in range(3):
            assert node_b.store.get(node_b.chunk_key(refs[1].token_ids)) is None
        assert answer(node_b, question, refs) == reference  # recomputed
        assert answer(node_b, question, refs) == reference  # now from B's RAM
        assert node_a.store.put(node_a.store.chunk_key([1, 2, 3]), node_a.precompute([1, 2, 3])) > 0
    # one warning per node (each would be its own process), not one per call
    warnings = remote_warnings(caplog)
    assert len(warnings) == 2 and all("unavailable" in text for text in warnings), warnings
    assert node_a.store.remote.counters.outages == node_b.store.remote.counters.outages == 1
    assert node_b.store.remote.counters.unavailable >= 3
    assert node_a.store.verify().clean and node_b.store.verify().clean

    redis_server.start(port=redis_server.port)  # back, empty, where the nodes expect it
    deadline = time.monotonic() + 60
    while not node_b.store.remote.contains("0" * 64) and not node_b.store.remote.available:
        assert time.monotonic() < deadline, "the tier did not come back"
        time.sleep(0.2)
    assert node_b.store.remote.put(node_b.store.chunk_key([1, 2, 3]), node_b.precompute([1, 2, 3])) > 0
    assert any("is back" in text for text in remote_warnings(caplog))


def test_unreachable_server_from_the_start(tmp_path, model, real_chunks, caplog):
    from redis_support import _free_port

    ids, kv = real_chunks[0]
    url = f"redis://127.0.0.1:{_free_port()}/0"  # nothing listens there
    store = KVStore(tmp_path, model.fingerprint, model.shape, "float16", remote=url)
    key = store.chunk_key(ids)
    with caplog.at_level(logging.WARNING):
        assert store.put(key, kv) > 0  # the local write is what counts
        store.evict_ram()
        assert_same_layers(store.get(key), kv)
        assert store.get(store.chunk_key(real_chunks[1][0])) is None
    assert len(remote_warnings(caplog)) == 1
    assert store.stats()["remote"]["available"] is False


def test_bad_remote_url_is_a_clear_error(tmp_path, shape):
    with pytest.raises(StoreError, match="expected redis://HOST:PORT/DB"):
        KVStore(tmp_path, FINGERPRINT, shape, remote="http://127.0.0.1:6379")
    with pytest.raises(StoreError, match="adhoc_ttl"):
        RedisKVTier("redis://127.0.0.1:1/0?adhoc_ttl=0", FINGERPRINT, shape)


# -- pinned corpus vs request traffic ------------------------------------------------------------------


def test_request_traffic_cannot_evict_the_pinned_corpus(redis_server, shape, make_kv, caplog):
    client = redis_server.client()
    tier = RedisKVTier(redis_server.url, FINGERPRINT, shape, "float16", local_cache_bytes=0)
    chunk_bytes = make_kv(n=256).to(torch.float16).nbytes  # 64 KiB
    baseline = client.info("memory")["used_memory"]
    client.config_set("maxmemory", baseline + 40 * chunk_bytes)

    corpus = {f"{i:064x}": make_kv(n=256, seed=i) for i in range(10)}
    for key, kv in corpus.items():
        assert tier.put(key, kv, pinned=True) > 0
    adhoc = [f"{1000 + i:064x}" for i in range(120)]  # three times what fits beside the corpus
    for i, key in enumerate(adhoc):
        tier.put(key, make_kv(n=256, seed=1000 + i), pinned=False)

    assert client.info("stats")["evicted_keys"] > 0
    assert all(client.ttl(tier.name_for(key)) == -1 for key in corpus)
    assert all(0 < client.ttl(tier.name_for(key)) <= tier.adhoc_ttl_s for key in adhoc if tier.contains(key))
    assert sum(tier.contains(key) for key in adhoc) < len(adhoc)
    for key, kv in corpus.items():
        assert_same_layers(tier.get(key), kv)
    stats = tier.stats()
    assert stats["pinned"] == len(corpus) and stats["server"]["maxmemory_policy"] == "volatile-lru"

    # an ad-hoc write never puts a TTL on corpus KV; a pinned write makes an ad-hoc copy permanent
    first_corpus = next(iter(corpus))
    assert tier.put(first_corpus, corpus[first_corpus], pinned=False) == 0
    assert client.ttl(tier.name_for(first_corpus)) == -1
    survivor = next(key for key in reversed(adhoc) if tier.contains(key))
    tier.put(survivor, make_kv(n=256), pinned=True)
    assert client.ttl(tier.name_for(survivor)) == -1

    # with only pinned data left, a full server refuses writes (one warning) and evicts nothing pinned
    with caplog.at_level(logging.WARNING):
        results = [tier.put(f"{5000 + i:064x}", make_kv(n=256, seed=i), pinned=True) for i in range(60)]
    assert 0 in results and tier.counters.errors >= 1
    refusals = [t for t in remote_warnings(caplog) if "used memory > 'maxmemory'" in t]
    assert len(refusals) == 1, remote_warnings(caplog)
    assert all(tier.contains(key) for key in corpus)


# -- maintenance ---------------------------------------------------------------------------------------


def test_verify_and_gc(redis_server, shape, make_kv):
    client = redis_server.client()
    tier = RedisKVTier(redis_server.url, FINGERPRINT, shape, "float16")
    ok, flipped, short, old_layout = (f"{i:064x}" for i in range(1, 5))
    for key in (ok, flipped, short, old_layout):
        tier.put(key, make_kv(n=8), pinned=key != ok)
    data = bytearray(client.hget(tier.name_for(flipped), "2"))
    data[5] ^= 0x01
    client.hset(tier.name_for(flipped), "2", bytes(data))
    client.hdel(tier.name_for(short), "3")
    meta = json.loads(client.hget(tier.name_for(old_layout), "meta"))
    stale = {k: v for k, v in meta.items() if k != "meta_crc32"} | {"layout_version": "0"}
    client.hset(tier.name_for(old_layout), "meta", json.dumps(stale | {"meta_crc32": metadata_crc(stale)}))
    client.set(f"{tier.prefix}:junk", b"x")
    client.set("another-app:key", b"kept")  # outside the prefix: never touched

    report = tier.verify()
    assert (report.checked, report.ok, report.pinned, report.adhoc) == (4, 1, 0, 1)
    assert {bad["key"] for bad in report.corrupt} == {flipped, short, old_layout}
    assert report.stray_keys == [f"{tier.prefix}:junk"] and not report.clean

    assert tier.gc() == {"checked": 4, "removed": 2, "stray_removed": 1}  # metadata-level damage only
    assert tier.contains(flipped) and not tier.contains(short) and not tier.contains(old_layout)
    assert tier.verify(repair=True).corrupt[0]["key"] == flipped
    after = tier.verify()
    assert after.clean and after.ok == 1
    assert client.get("another-app:key") == b"kept"
    stats = tier.stats()
    assert stats["entries"] == 1 and stats["bytes"] == make_kv(n=8).to(torch.float16).nbytes


def test_metadata_is_the_disk_formats(tmp_path, redis_server, shape, make_kv):
    """The remote value carries exactly the metadata a disk file of the same chunk carries."""
    from safetensors import safe_open

    kv = make_kv(n=12)
    store = KVStore(tmp_path, FINGERPRINT, shape, "float16", remote=redis_server.url)
    key = store.chunk_key(range(12))
    store.put(key, kv)
    with safe_open(str(store.path_for(key)), "pt") as handle:
        on_disk = handle.metadata()
    remote = json.loads(redis_server.client().hget(store.remote.name_for(key), "meta"))
    assert remote == on_disk
    crcs = [int(c, 16) for c in on_disk["layer_crc32"].split(",")]
    assert build_metadata(key, FINGERPRINT, "float16", shape, 12, crcs) == on_disk
    with pytest.raises(CorruptKVError):  # a layer deleted after the chunk was found
        source = RedisKVTier(redis_server.url, FINGERPRINT, shape, "float16").get(key)
        redis_server.client().hdel(store.remote.name_for(key), "1")
        read_all(source)
