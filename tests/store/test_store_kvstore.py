"""The tiered KV store: round trips, LRU budgets, integrity, crash safety and concurrency."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import sqlite3
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from store_support import (
    BIG_SHAPE,
    FINGERPRINT,
    OTHER_FINGERPRINT,
    big_chunk,
    flip_byte,
    release_when_ready,
    start_child,
    tensor_span,
    wait_for,
)

from cacheblend_rag.blend.segments import ChunkKVSource, prefill_chunk_kv
from cacheblend_rag.errors import CorruptKVError, StoreError
from cacheblend_rag.store import disk, fileformat
from cacheblend_rag.store.kvstore import DiskChunkKV, KVStore, tier_of


def open_store(root: Path, shape, **kwargs) -> KVStore:
    return KVStore(root, FINGERPRINT, shape, "float16", **kwargs)


def assert_same_kv(source, kv, dtype=torch.float16) -> None:
    assert source.num_layers == kv.num_layers and source.num_tokens == kv.num_tokens
    for i in range(kv.num_layers):
        k, v = source.layer(i)
        assert k.dtype == dtype
        assert torch.equal(k, kv.keys[i].to(dtype)) and torch.equal(v, kv.values[i].to(dtype))


def file_size(store: KVStore, key: str) -> int:
    return store.path_for(key).stat().st_size


# -- round trips ---------------------------------------------------------------------------------------


def test_put_get_round_trip_through_ram_and_disk(tmp_path, shape, make_kv):
    kv = make_kv(n=16)
    store = open_store(tmp_path, shape)
    key = store.chunk_key(range(16))
    written = store.put(key, kv)
    assert written == file_size(store, key)
    assert store.contains(key)

    from_ram = store.get(key)
    assert tier_of(from_ram) == "ram"
    assert_same_kv(from_ram, kv)
    assert store.counters.ram_hits == 1

    fresh = open_store(tmp_path, shape)  # another process: nothing in its RAM tier
    source = fresh.get(key)
    assert isinstance(source, DiskChunkKV) and isinstance(source, ChunkKVSource) and tier_of(source) == "disk"
    assert fresh.get(key) is source  # while in use, the same reader is shared
    assert_same_kv(source, kv)
    assert fresh.counters.disk_hits == 2 and fresh.counters.ram_misses == 2
    assert fresh.counters.disk_layer_reads[key] == shape.num_layers
    assert fresh.counters.disk_bytes_read == kv.to(torch.float16).nbytes
    # every layer read once: promoted into RAM; reading it again does not touch the disk
    assert tier_of(fresh.get(key)) == "ram"
    assert_same_kv(source, kv)
    assert fresh.counters.disk_layer_reads[key] == shape.num_layers


def test_storage_dtype_is_independent_of_input_dtype(tmp_path, shape, make_kv):
    kv = make_kv(dtype=torch.float32)
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        store = KVStore(tmp_path / name, FINGERPRINT, shape, name)
        key = store.chunk_key([1, 2, 3])
        store.put(key, kv)
        store.evict_ram()
        assert_same_kv(store.get(key), kv, dtype)


def test_second_put_of_a_stored_chunk_writes_nothing(tmp_path, shape, make_kv):
    store = open_store(tmp_path, shape)
    key = store.chunk_key([5, 6])
    assert store.put(key, make_kv()) > 0
    mtime = store.path_for(key).stat().st_mtime_ns
    assert store.put(key, make_kv()) == 0
    assert store.path_for(key).stat().st_mtime_ns == mtime


def test_get_many_maps_repeated_keys_to_one_source(tmp_path, shape, make_kv):
    store = open_store(tmp_path, shape, promote_on_read=False)
    key = store.chunk_key([1])
    store.put(key, make_kv())
    store.evict_ram()
    a, b, missing = store.get_many([key, key, store.chunk_key([2])])
    assert a is b and missing is None
    for i in range(shape.num_layers):
        a.layer(i)
    assert store.counters.disk_layer_reads[key] == shape.num_layers


def test_put_rejects_foreign_or_malformed_kv(tmp_path, shape, make_kv):
    store = open_store(tmp_path, shape)
    key = store.chunk_key([1, 2])
    with pytest.raises(StoreError, match="cannot go into the store of model"):
        store.put(key, make_kv(fingerprint=OTHER_FINGERPRINT))
    short = make_kv()
    short.keys.pop()
    short.values.pop()
    with pytest.raises(StoreError, match="layers"):
        store.put(key, short)
    bad = make_kv()
    bad.values[1] = bad.values[1][:, :-1]
    with pytest.raises(StoreError, match="layer 1 K/V shapes"):
        store.put(key, bad)
    with pytest.raises(ValueError, match="invalid KV key"):
        store.put("../../etc/passwd", make_kv())
    assert not store.contains(key)


def test_put_async_writes_in_background(tmp_path, shape, make_kv):
    store = open_store(tmp_path, shape)
    key = store.chunk_key([9])
    future = store.put_async(key, make_kv())
    store.flush()
    assert future.result() > 0 and store.path_for(key).is_file()
    store.close()


# -- budgets -------------------------------------------------------------------------------------------


def test_ram_tier_evicts_least_recently_used_at_the_byte_budget(tmp_path, shape, make_kv):
    chunk_bytes = make_kv().to(torch.float16).nbytes
    store = open_store(tmp_path, shape, ram_budget_bytes=int(2.5 * chunk_bytes))
    a, b, c = (store.chunk_key([i]) for i in range(3))
    store.put(a, make_kv(seed=1))
    store.put(b, make_kv(seed=2))
    store.get(a)  # a is now more recent than b
    store.put(c, make_kv(seed=3))
    stats = store.stats()["ram"]
    assert stats["entries"] == 2 and stats["bytes"] == 2 * chunk_bytes <= stats["budget_bytes"]
    assert tier_of(store.get(a)) == "ram" and tier_of(store.get(c)) == "ram"
    assert tier_of(store.get(b)) == "disk"  # evicted from RAM, still on disk
    assert store.counters.ram_evictions == 1


def test_disk_tier_evicts_least_recently_used_at_the_byte_budget(tmp_path, shape, make_kv):
    store = open_store(tmp_path, shape)
    probe = store.chunk_key([99])
    size = store.put(probe, make_kv())
    store.delete(probe)
    store = open_store(tmp_path, shape, disk_budget_bytes=int(2.5 * size))
    a, b, c = (store.chunk_key([i]) for i in range(3))
    store.put(a, make_kv(seed=1))
    store.put(b, make_kv(seed=2))
    store.get(a)
    store.put(c, make_kv(seed=3))
    assert store.path_for(a).is_file() and store.path_for(c).is_file()
    assert not store.path_for(b).exists()
    assert store.counters.disk_evictions == 1
    assert store.stats()["disk"]["bytes"] <= int(2.5 * size)

    store.disk_budget_bytes = size  # a smaller budget takes effect at the next gc
    store.get(a)
    assert store.gc()["evicted"] == 1
    assert store.path_for(a).is_file() and not store.path_for(c).exists()


# -- integrity -----------------------------------------------------------------------------------------


def stored(tmp_path, shape, make_kv, root="store"):
    store = open_store(tmp_path / root, shape)
    kv = make_kv(n=12, seed=4)
    key = store.chunk_key(range(12))
    store.put(key, kv)
    store.evict_ram()
    return store, key, kv


def assert_recovers(store, key, kv) -> None:
    """The bad entry is gone; storing the recomputed chunk serves the clean KV again."""
    assert not store.path_for(key).exists()
    assert store.get(key) is None
    assert store.index.sql("SELECT count(*) FROM chunks WHERE key = ?", (key,))[0][0] == 0
    store.put(key, kv)
    store.evict_ram()
    assert_same_kv(store.get(key), kv)


def test_flipped_byte_in_a_layer_raises_corrupt_kv_error_on_read(tmp_path, shape, make_kv, caplog):
    store, key, kv = stored(tmp_path, shape, make_kv)
    start, _ = tensor_span(store.path_for(key), "layers.2.values")
    flip_byte(store.path_for(key), start + 5)
    source = store.get(key)
    assert source is not None  # the header is intact; layers 0 and 1 are still good
    source.layer(0), source.layer(1)
    with caplog.at_level(logging.WARNING), pytest.raises(CorruptKVError) as err:
        source.layer(2)
    assert err.value.key == key and err.value.layer == 2
    assert "layer 2 checksum mismatch" in caplog.text
    assert store.counters.corrupt == 1
    assert_recovers(store, key, kv)


def damage_header(path: Path) -> None:
    data = path.read_bytes()
    at = data.index(FINGERPRINT.encode())
    path.write_bytes(data[:at] + b"c" + data[at + 1 :])


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def empty(path: Path) -> None:
    path.write_bytes(b"")


def garbage(path: Path) -> None:
    path.write_bytes(os.urandom(4096))


@pytest.mark.parametrize("damage", [damage_header, truncate, empty, garbage])
def test_damaged_file_is_a_logged_miss(tmp_path, shape, make_kv, caplog, damage):
    store, key, kv = stored(tmp_path, shape, make_kv)
    damage(store.path_for(key))
    with caplog.at_level(logging.WARNING):
        assert store.get(key) is None
    assert "unusable" in caplog.text and key[:16] in caplog.text
    assert store.counters.corrupt == 1 and store.counters.disk_misses == 1
    assert_recovers(store, key, kv)


def test_file_of_another_model_is_never_used(tmp_path, shape, make_kv, caplog):
    store, key, kv = stored(tmp_path, shape, make_kv)
    other = KVStore(tmp_path / "other", OTHER_FINGERPRINT, shape, "float16")
    other_key = other.chunk_key(range(12))
    assert other_key != key  # the same tokens under another model have another key
    other.put(other_key, make_kv(n=12, seed=5, fingerprint=OTHER_FINGERPRINT))
    store.path_for(key).write_bytes(other.path_for(other_key).read_bytes())  # a foreign file put in place
    with caplog.at_level(logging.WARNING):
        assert store.get(key) is None
    assert "not the key it is stored under" in caplog.text
    assert_recovers(store, key, kv)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("model_fingerprint", OTHER_FINGERPRINT, "foreign file of model"),
        ("kv_dtype", "bfloat16", "foreign file in bfloat16"),
        ("layout_version", "0", "layout version 0"),
    ],
)
def test_file_with_foreign_metadata_is_never_used(tmp_path, shape, make_kv, caplog, field, value, message):
    """A well-formed file whose checksummed metadata names another model, dtype or layout."""
    store, key, kv = stored(tmp_path, shape, make_kv)
    path = store.path_for(key)
    with safe_open(str(path), "pt") as handle:
        tensors = {name: handle.get_tensor(name).clone() for name in handle.keys()}  # noqa: SIM118 (not a dict)
        meta = dict(handle.metadata())
    meta[field] = value
    if field == "kv_dtype":
        tensors = {name: t.to(torch.bfloat16) for name, t in tensors.items()}
    fields = {k: v for k, v in meta.items() if k != "meta_crc32"}
    meta["meta_crc32"] = fileformat.metadata_crc(fields)
    save_file(tensors, str(path), metadata=meta)
    with caplog.at_level(logging.WARNING):
        assert store.get(key) is None
    assert message in caplog.text
    assert_recovers(store, key, kv)


def test_recomputed_chunk_after_corruption_equals_the_clean_one(tmp_path, model, real_chunks):
    """End to end with the real model: a corrupt layer is detected while loading, the chunk is recomputed
    and stored again, and the KV then served is exactly the clean run's."""
    from cacheblend_rag.store.pipeline import PipelinedLayerLoader

    ids, clean = real_chunks[0]
    store = KVStore(tmp_path, model.fingerprint, model.shape, "float16")
    key = store.chunk_key(ids)
    store.put(key, clean)
    store.evict_ram()
    start, end = tensor_span(store.path_for(key), "layers.17.keys")
    flip_byte(store.path_for(key), (start + end) // 2)
    with PipelinedLayerLoader([store.get(key)], model.dtype) as loader, pytest.raises(CorruptKVError) as err:
        for layer in range(model.num_layers):
            loader.layer(layer)
    assert err.value.key == key and err.value.layer == 17
    assert store.get(key) is None
    store.put(key, prefill_chunk_kv(model, ids))
    store.evict_ram()
    assert_same_kv(store.get(key), clean)


# -- verify / gc / maintenance --------------------------------------------------------------------------


def test_verify_reports_and_repairs(tmp_path, shape, make_kv):
    store = open_store(tmp_path, shape)
    good, bad, orphan, gone = (store.chunk_key([i]) for i in range(4))
    for i, key in enumerate((good, bad, orphan, gone)):
        store.put(key, make_kv(seed=i))
    start, _ = tensor_span(store.path_for(bad), "layers.3.keys")
    flip_byte(store.path_for(bad), start)
    store.index.sql("DELETE FROM chunks WHERE key = ?", (orphan,))  # its writer died before indexing it
    store.path_for(gone).unlink()

    report = store.verify()
    assert (report.checked, report.ok) == (3, 2)
    assert [c["key"] for c in report.corrupt] == [bad] and "layer 3" in report.corrupt[0]["reason"]
    assert report.orphan_files == [orphan] and report.missing_files == [gone]
    assert store.path_for(bad).exists()  # verify alone changes nothing

    repaired = store.verify(repair=True)
    assert repaired.repaired and not store.path_for(bad).exists()
    after = store.verify()
    assert after.clean and after.ok == 2
    store.evict_ram()
    assert_same_kv(store.get(orphan), make_kv(seed=2))


def test_gc_reconciles_index_and_files(tmp_path, shape, make_kv):
    store = open_store(tmp_path, shape)
    keys = [store.chunk_key([i]) for i in range(3)]
    for key in keys:
        store.put(key, make_kv())
    store.index.sql("DELETE FROM chunks WHERE key = ?", (keys[0],))
    store.path_for(keys[1]).unlink()
    garbage(store.path_for(keys[2]))
    store.index.sql("DELETE FROM chunks WHERE key = ?", (keys[2],))
    report = store.gc()
    assert report["files_indexed"] == 1 and report["rows_dropped"] == 1 and report["files_removed"] == 1
    assert store.verify().clean
    assert store.stats()["disk"]["entries"] == 1


def test_delete_clear_and_stats(tmp_path, shape, make_kv):
    store = open_store(tmp_path, shape)
    a, b = store.chunk_key([1]), store.chunk_key([2])
    store.put(a, make_kv())
    store.put(b, make_kv())
    assert store.delete(a) and not store.contains(a) and not store.delete(a)
    stats = store.stats()
    assert stats["disk"]["entries"] == 1 and stats["ram"]["entries"] == 1
    assert json.loads(json.dumps(stats)) == stats
    assert store.clear() == 1
    assert store.stats()["disk"]["entries"] == 0 and not store.contains(b)


def test_open_existing_reads_model_and_shape_from_the_index(tmp_path, shape, make_kv):
    store = open_store(tmp_path, shape)
    store.put(store.chunk_key([1]), make_kv())
    again = KVStore.open_existing(tmp_path)
    assert (again.fingerprint, again.shape, again.kv_dtype) == (FINGERPRINT, shape, torch.float16)
    KVStore(tmp_path, OTHER_FINGERPRINT, shape)
    with pytest.raises(StoreError, match="several models"):
        KVStore.open_existing(tmp_path)
    assert KVStore.open_existing(tmp_path, OTHER_FINGERPRINT).fingerprint == OTHER_FINGERPRINT
    with pytest.raises(StoreError, match="no KV store"):
        KVStore.open_existing(tmp_path / "nothing")


def test_files_are_not_world_writable(tmp_path, shape, make_kv):
    old = os.umask(0)
    try:
        store = open_store(tmp_path / "s", shape)
        store.put(store.chunk_key([1]), make_kv())
    finally:
        os.umask(old)
    for path in [tmp_path / "s", *(tmp_path / "s").rglob("*")]:
        assert not path.stat().st_mode & stat.S_IWOTH, path


# -- crash safety and concurrency ------------------------------------------------------------------------


def test_two_concurrent_writers_of_one_chunk_leave_one_valid_file(tmp_path):
    sync = tmp_path / "sync"
    sync.mkdir()
    root = tmp_path / "kv"
    children = [start_child("put-same", root, sync, 512) for _ in range(2)]
    release_when_ready(sync, 2)
    written = sorted(int(child.communicate(timeout=120)[0]) for child in children)
    assert [child.returncode for child in children] == [0, 0]
    store = KVStore(root, FINGERPRINT, BIG_SHAPE, "float16")  # exact round trips: a lossless codec
    key = store.chunk_key(range(512))
    # the lock made the second writer find the first one's file and keep it
    assert written == [0, store.path_for(key).stat().st_size]
    files = [f for f in (root / "chunks").rglob("*") if f.is_file()]
    assert files == [store.path_for(key)]  # no temp file left behind
    assert store.verify().clean
    assert store.index.sql("SELECT count(*) FROM chunks")[0][0] == 1
    assert_same_kv(store.get(key), big_chunk(512, seed=0))


def test_concurrent_processes_writing_different_chunks_share_one_index(tmp_path):
    sync = tmp_path / "sync"
    sync.mkdir()
    root = tmp_path / "kv"
    children = [start_child("put-many", root, sync, first, 6) for first in (0, 6)]
    release_when_ready(sync, 2)
    for child in children:
        child.communicate(timeout=120)
        assert child.returncode == 0
    store = KVStore(root, FINGERPRINT, BIG_SHAPE, "float16")  # exact round trips: a lossless codec
    assert store.stats()["disk"]["entries"] == 12
    assert store.verify().clean


def test_writer_killed_mid_write_leaves_nothing_that_is_used(tmp_path):
    sync = tmp_path / "sync"
    sync.mkdir()
    root = tmp_path / "kv"
    child = start_child("put-and-stall", root, sync, 256)
    try:
        wait_for(sync / "halfway")
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=30)

    store = KVStore(root, FINGERPRINT, BIG_SHAPE, "float16")  # exact round trips: a lossless codec
    key = store.chunk_key(range(256))
    temps = list((root / "chunks").rglob("*.tmp"))
    assert len(temps) == 1 and not store.path_for(key).exists()
    assert store.get(key) is None and store.counters.corrupt == 0  # a plain miss: recompute
    assert [Path(p) for p in store.verify().stale_temp_files] == temps
    assert store.gc()["temp_removed"] == 1 and not temps[0].exists()
    kv = big_chunk(256, seed=0)
    store.put(key, kv)
    store.evict_ram()
    assert_same_kv(store.get(key), kv)


def test_injected_disk_full_is_a_clear_error_and_changes_nothing(tmp_path, shape, make_kv, monkeypatch):
    store = open_store(tmp_path, shape)
    kept = store.chunk_key([1])
    store.put(kept, make_kv(seed=1))

    def full_disk(fd, data):
        os.write(fd, data[:100])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk, "_write_all", full_disk)
    new = store.chunk_key([2])
    with pytest.raises(StoreError, match="disk full"):
        store.put(new, make_kv(seed=2))
    assert not store.contains(new) and not list(tmp_path.rglob("*.tmp"))
    store.evict_ram()
    assert_same_kv(store.get(kept), make_kv(seed=1))
    assert store.verify().clean


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a small tmpfs (needs root, which the CI and dev machines run as)."""
    mounted = []

    def mount(size: str) -> Path:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], check=False
        )
        if result.returncode != 0:
            pytest.skip("mounting a tmpfs needs root")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_real_disk_full_is_a_clear_error_and_changes_nothing(tmpfs):
    root = tmpfs("4m") / "kv"
    store = KVStore(root, FINGERPRINT, BIG_SHAPE, "float16")  # exact round trips: a lossless codec
    kv = big_chunk(64, seed=0)  # ~1.2 MB per file in fp16
    kept = [store.chunk_key([i] * 64) for i in range(2)]
    for key in kept:
        store.put(key, kv)
    with pytest.raises(StoreError, match="disk full"):
        for i in range(2, 6):
            store.put(store.chunk_key([i] * 64), kv)
    assert not list(root.rglob("*.tmp"))
    store.evict_ram()
    for key in kept:
        assert_same_kv(store.get(key), kv)
    assert not store.verify().corrupt


def test_read_only_store_serves_reads_and_refuses_writes(tmpfs, shape, make_kv):
    point = tmpfs("16m")
    store = open_store(point / "kv", shape)
    key = store.chunk_key([1])
    store.put(key, make_kv(seed=1))
    store.close()
    subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)

    ro = open_store(point / "kv", shape)
    assert ro.read_only and ro.stats()["disk"]["entries"] == 1
    assert_same_kv(ro.get(key), make_kv(seed=1))
    with pytest.raises(StoreError, match="read-only"):
        ro.put(ro.chunk_key([2]), make_kv(seed=2))
    with pytest.raises(StoreError, match="read-only"):
        ro.gc()
    assert ro.verify().clean


def test_index_rows_match_files(tmp_path, shape, make_kv):
    store = open_store(tmp_path, shape)
    key = store.chunk_key([3])
    size = store.put(key, make_kv())
    with sqlite3.connect(tmp_path / "index.sqlite") as db:
        row = db.execute(
            "SELECT model_fingerprint, kv_dtype, num_tokens, size_bytes, tier FROM chunks"
        ).fetchone()
        (mode,) = db.execute("PRAGMA journal_mode").fetchone()
    assert row == (FINGERPRINT, "float16", 16, size, "disk") and mode == "wal"
