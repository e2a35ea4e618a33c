"""Openings' exact KV beside a store's chunks (store/exact.py): kept in full precision, keyed apart from
chunk KV, checked when read, bounded, and never a reason for an answer to fail."""

from __future__ import annotations

import os

import torch
from store_support import FINGERPRINT

from cacheblend_rag.store.exact import EXACT_DIR, ExactKVFiles, clear_exact_files
from cacheblend_rag.store.kvstore import KVStore

IDS = list(range(5, 17))


def _files(tmp_path, shape, **options) -> ExactKVFiles:
    return ExactKVFiles(tmp_path, FINGERPRINT, shape, torch.float32, "cpu", **options)


def test_kept_bit_for_bit_and_keyed_apart_from_chunks(tmp_path, shape, make_kv):
    exact = _files(tmp_path, shape)
    kv = make_kv(len(IDS))
    assert exact.get(IDS) is None
    exact.put(IDS, kv)
    got = exact.get(IDS)
    assert got is not None and got.num_tokens == len(IDS)
    for layer in range(shape.num_layers):
        assert all(torch.equal(a, b) for a, b in zip(got.layer(layer), kv.layer(layer), strict=True))
    # not a chunk of the store (whatever its codec), nor KV computed on another kind of device
    store = KVStore(tmp_path, FINGERPRINT, shape, "float32")
    assert exact.key(IDS) != store.chunk_key(IDS)
    assert _files(tmp_path, shape).key(IDS) != ExactKVFiles(
        tmp_path, FINGERPRINT, shape, torch.float32, "cuda"
    ).key(IDS)
    assert store.get(exact.key(IDS)) is None
    store.close()


def test_a_bad_file_is_a_miss_and_removed(tmp_path, shape, make_kv):
    exact = _files(tmp_path, shape)
    exact.put(IDS, make_kv(len(IDS)))
    path = exact.path_for(exact.key(IDS))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a flipped byte in the last layer
    path.write_bytes(bytes(data))
    assert exact.get(IDS) is None
    assert not path.exists()


def test_bounded_least_recently_read_first_and_leftovers_removed(tmp_path, shape, make_kv):
    exact = _files(tmp_path, shape, max_files=2)
    runs = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    exact.put(runs[0], make_kv(3, seed=0))
    exact.put(runs[1], make_kv(3, seed=1))
    old = exact.path_for(exact.key(runs[1]))
    os.utime(old, (1, 1))  # read long ago: the first to go
    left = old.with_name(".left-by-a-killed-writer.1.ab.tmp")
    left.write_bytes(b"half a file")
    os.utime(left, (1, 1))
    exact.put(runs[2], make_kv(3, seed=2))
    assert [exact.get(ids) is not None for ids in runs] == [True, False, True]
    assert not left.exists()


def test_read_only_or_too_long_writes_nothing_and_clear_removes_all(tmp_path, shape, make_kv):
    _files(tmp_path, shape, writable=False).put(IDS, make_kv(len(IDS)))
    _files(tmp_path, shape, max_tokens=len(IDS) - 1).put(IDS, make_kv(len(IDS)))
    assert not (tmp_path / EXACT_DIR).exists()
    _files(tmp_path, shape).put(IDS, make_kv(len(IDS)))
    store = KVStore(tmp_path, FINGERPRINT, shape, "int8")
    store.clear()  # the store's clear takes the openings too
    store.close()
    assert _files(tmp_path, shape).get(IDS) is None
    assert clear_exact_files(tmp_path) == 0
