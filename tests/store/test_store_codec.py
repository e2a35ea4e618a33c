"""Chunk KV codecs: round-trip error on the default model's KV, bytes per token, format versioning
(layout-1 files read as they were, unknown codecs refused by name), keys per codec, the RAM and remote
tiers holding encoded bytes, and fusion on a quantized store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from store_support import BIG_SHAPE, FINGERPRINT, big_chunk

from cacheblend_rag.blend.segments import ChunkKV
from cacheblend_rag.engine import ChunkRef, Engine, SamplingParams
from cacheblend_rag.store.codec import CODECS, UnknownCodecError, get_codec
from cacheblend_rag.store.fileformat import (
    InvalidKVFile,
    build_metadata,
    decode,
    encode,
    metadata_crc,
    parse_metadata,
)
from cacheblend_rag.store.keys import chunk_key
from cacheblend_rag.store.kvstore import KVStore, tier_of
from cacheblend_rag.store.remote import RedisKVTier

DATA_DIR = Path(__file__).parents[1] / "data"
# Relative RMS error bounds of a round trip on real chunk KV, over all layers (measured: int8 K 0.004 /
# V 0.007, int4 K 0.05 / V 0.10 on a 512-token chunk of the sample corpus; docs/store.md).
ERROR_BOUNDS = {"float16": 1e-3, "bfloat16": 5e-3, "float32": 0.0, "int8": 0.01, "int4": 0.12}


def relative_rmse(decoded: torch.Tensor, original: torch.Tensor) -> float:
    return ((decoded.float() - original.float()).pow(2).sum() / original.float().pow(2).sum()).sqrt().item()


@pytest.mark.parametrize("name", list(CODECS))
def test_round_trip_error_is_bounded_per_codec(model, real_chunks, name):
    ids, kv = real_chunks[0]
    key = chunk_key(model.fingerprint, name, ids)
    encoded = encode(key, kv, model.fingerprint, model.shape, CODECS[name])
    meta, back = decode(encoded.data(), key)
    assert meta.kv_dtype == name and meta.codec == CODECS[name]
    for layer in range(model.shape.num_layers):
        k, v = back.layer(layer)
        assert k.dtype == v.dtype == CODECS[name].dtype and k.shape == kv.keys[layer].shape
        assert torch.equal(k, encoded.layer(layer)[0])  # what the RAM tier serves is what the file holds
        # any one layer within twice the bound, all layers together within it
        assert relative_rmse(k, kv.keys[layer]) <= 2 * ERROR_BOUNDS[name], (name, layer)
        assert relative_rmse(v, kv.values[layer]) <= 2 * ERROR_BOUNDS[name], (name, layer)
    for decoded, original in ((back.keys, kv.keys), (back.values, kv.values)):
        assert relative_rmse(torch.cat(decoded, 1), torch.cat(original, 1)) <= ERROR_BOUNDS[name]
    if name == "int4":  # int4 is not int8 in disguise: it loses more
        k8 = CODECS["int8"].decode(CODECS["int8"].encode(*kv.layer(1)))[0]
        assert relative_rmse(k8, kv.keys[1]) < relative_rmse(back.keys[1], kv.keys[1])


@pytest.mark.parametrize("n", [512, 97])
def test_file_bytes_per_token_against_float16(tmp_path, n):
    kv = big_chunk(n, seed=1)  # the default model's shape
    sizes = {}
    for name in ("float16", "int8", "int4"):
        store = KVStore(tmp_path / name, FINGERPRINT, BIG_SHAPE, name, ram_budget_bytes=0)
        key = store.chunk_key(range(n))
        store.put(key, kv)
        sizes[name] = store.path_for(key).stat().st_size  # file bytes, metadata included
        assert store.stats()["disk"]["by_codec"][name]["bytes_per_token"] == sizes[name] / n
        store.close()
    limits = (0.52, 0.30) if n == 512 else (0.54, 0.33)  # a short chunk pays a whole key group's scales
    assert sizes["int8"] <= limits[0] * sizes["float16"]
    assert sizes["int4"] <= limits[1] * sizes["float16"]


def test_a_layout_1_file_is_read_as_it_was_and_float16_is_written_unchanged(shape):
    recorded = json.loads((DATA_DIR / "layout1_float16.json").read_text())
    data = (DATA_DIR / "layout1_float16.safetensors").read_bytes()
    key = chunk_key(recorded["fingerprint"], "float16", recorded["token_ids"], recorded["context"])
    assert key == recorded["key"]  # a float16 corpus keeps its keys: its KV still hits
    meta, back = decode(data, key)
    assert (meta.layout_version, meta.kv_dtype, meta.num_tokens) == (1, "float16", 6)
    generator = torch.Generator().manual_seed(recorded["seed"])
    dims = (shape.num_kv_heads, 6, shape.head_dim)
    keys = [torch.randn(dims, generator=generator) for _ in range(shape.num_layers)]
    values = [torch.randn(dims, generator=generator) for _ in range(shape.num_layers)]
    for layer in range(shape.num_layers):
        assert torch.equal(back.keys[layer], keys[layer].half())
        assert torch.equal(back.values[layer], values[layer].half())
    again = encode(
        key, ChunkKV(keys, values, recorded["fingerprint"]), recorded["fingerprint"], shape, "float16"
    )
    assert split_file(again.data()) == split_file(data)  # the same header (in any key order) and bytes


def split_file(data: bytes) -> tuple[dict, bytes]:
    """A safetensors file as its header (parsed: safetensors writes metadata in no fixed order) and its
    tensor bytes."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def forged(metadata: dict[str, str], **changes: str) -> dict[str, str]:
    fields = {k: v for k, v in metadata.items() if k != "meta_crc32"}
    fields.update(changes)
    return {**fields, "meta_crc32": metadata_crc(fields)}


def test_an_unknown_codec_is_refused_by_name(shape, make_kv):
    key = "c" * 64
    encoded = encode(key, make_kv(n=8), FINGERPRINT, shape, "int8")
    assert parse_metadata(encoded.metadata, key).codec == CODECS["int8"].for_head_dim(shape.head_dim)
    for changes, message in [
        ({"kv_dtype": "int3"}, "unknown codec 'int3'"),
        ({"kv_dtype": "float16"}, "unknown codec 'float16' in layout version 2"),  # never misread
        ({"layout_version": "3"}, "layout version 3"),
        ({"codec_params": '{"bits": 4}'}, "codec int8 with unreadable parameters"),
    ]:
        with pytest.raises(InvalidKVFile, match=message):
            parse_metadata(forged(encoded.metadata, **changes), key)
    with pytest.raises(UnknownCodecError, match="unknown KV codec 'int3'"):
        get_codec("int3")
    # a quantized file records its own group sizes, and is read with them
    int4 = CODECS["int4"].for_head_dim(shape.head_dim)
    meta = build_metadata(key, FINGERPRINT, int4, shape, 8, [0] * shape.num_layers)
    other = forged(meta, codec_params=meta["codec_params"].replace('"key_group": 128', '"key_group": 32'))
    assert parse_metadata(other, key).codec.key_group == 32


def test_two_codecs_never_share_a_key():
    keys = {chunk_key(FINGERPRINT, name, [1, 2, 3]) for name in CODECS}
    assert len(keys) == len(CODECS)
    assert chunk_key(FINGERPRINT, "fp16", [1, 2, 3]) == chunk_key(FINGERPRINT, torch.float16, [1, 2, 3])


def test_the_ram_tier_keeps_encoded_bytes_and_decodes_per_layer(tmp_path, model, real_chunks):
    ids, kv = real_chunks[1]
    store = KVStore(tmp_path, model.fingerprint, model.shape, "int4")
    key = store.chunk_key(ids)
    store.put(key, kv)
    held = store.get(key)
    assert tier_of(held) == "ram" and store.ram.bytes == held.nbytes
    assert held.nbytes < 0.5 * kv.to(torch.float16).nbytes  # (a 13-token chunk: one key group of scales)
    store.evict_ram()
    from_disk = store.get(key)
    assert tier_of(from_disk) == "disk"
    layers = [from_disk.layer(i) for i in range(model.shape.num_layers)]  # promoted once all are read
    promoted = store.get(key)
    assert tier_of(promoted) == "ram" and store.ram.bytes == promoted.nbytes == held.nbytes
    for i, (k, v) in enumerate(layers):
        assert k.dtype == torch.float16
        assert torch.equal(k, promoted.layer(i)[0]) and torch.equal(v, held.layer(i)[1])
    assert store.verify().clean
    store.close()


def test_the_remote_tier_stores_and_sends_encoded_bytes(tmp_path, redis_server, model, real_chunks):
    ids, kv = real_chunks[0]
    writer = KVStore(tmp_path / "a", model.fingerprint, model.shape, "int8", remote=redis_server.url)
    key = writer.chunk_key(ids)
    writer.put(key, kv)
    local = writer.get(key)
    reader_tier = RedisKVTier(redis_server.url, model.fingerprint, model.shape, "int8", local_cache_bytes=0)
    source = reader_tier.get(key)
    for i in range(model.shape.num_layers):
        assert torch.equal(source.layer(i)[0], local.layer(i)[0])
    assert reader_tier.counters.bytes_read == local.nbytes  # encoded bytes on the wire
    assert reader_tier.verify().clean
    with pytest.raises(Exception, match="another model or storage codec"):
        KVStore(tmp_path / "b", model.fingerprint, model.shape, "int4", remote=reader_tier)
    reader_tier.close()
    writer.close()


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_fusion_runs_unchanged_on_a_quantized_store(tmp_path, model, real_chunks, name):
    refs_ids = [ids for ids, _ in real_chunks]
    results = {}
    for codec in ("float16", name):
        engine = Engine(model=model, store=KVStore(tmp_path / codec, model.fingerprint, model.shape, codec))
        refs = [ChunkRef(tuple(ids), f"c{i}") for i, ids in enumerate(refs_ids)]
        segments = engine.rag_segments("Who won Nobel Prizes?", refs, "cacheblend")
        first = engine.generate(segments, "cacheblend", SamplingParams(max_tokens=4), ratio=0.15)
        again = engine.generate(
            engine.rag_segments("Who won Nobel Prizes?", refs, "cacheblend"),
            "cacheblend",
            SamplingParams(max_tokens=4),
            ratio=0.15,
        )
        assert first.text == again.text  # computed then served from the store: the same answer
        results[codec] = first.text
        engine.close()
    assert results[name]  # an answer, from KV dequantized to the compute dtype
    if name == "int8":  # 0.5% error in K/V does not change a greedy answer this short
        assert results[name] == results["float16"]


def test_the_codec_bench_reads_a_chunk_through_a_real_redis(redis_server, model, real_chunks, monkeypatch):
    from types import SimpleNamespace

    from cacheblend_rag.eval.bench.codec import remote_read
    from cacheblend_rag.settings import get_settings

    monkeypatch.setenv("CACHEBLEND_KV_REMOTE", redis_server.url)
    get_settings.cache_clear()
    ids, _ = real_chunks[0]
    measured = remote_read(SimpleNamespace(model=model, config=SimpleNamespace(repeats=2)), tuple(ids))
    codecs = measured["codecs"]
    assert codecs["float16"]["bytes"] == len(ids) * 23_040  # every layer's K and V, nothing cached locally
    assert codecs["int4"]["bytes"] < codecs["int8"]["bytes"] < codecs["float16"]["bytes"]
    assert all(c["seconds"] > 0 for c in codecs.values())
    assert redis_server.client().keys("cacheblend:bench-codec:*") == []  # its values are removed after
