"""The chunk KV file format on bytes, without a file: what a tier that keeps whole chunks elsewhere (a
remote cache) stores and reads back, with the same checks the disk tier makes."""

from __future__ import annotations

import json

import pytest
import torch
from store_support import FINGERPRINT

from cacheblend_rag.errors import StoreError
from cacheblend_rag.store.fileformat import InvalidKVFile, decode, encode, layer_tensor_names
from cacheblend_rag.store.keys import chunk_key

KEY = chunk_key(FINGERPRINT, "float16", [1, 2, 3])


def test_round_trip_keeps_every_layer_and_the_model(shape, make_kv):
    kv = make_kv(n=12, seed=3)
    encoded = encode(KEY, kv, FINGERPRINT, shape, torch.float16)
    meta, back = decode(encoded.data(), KEY)
    assert (meta.model_fingerprint, meta.kv_dtype, meta.num_tokens) == (FINGERPRINT, "float16", 12)
    assert len(meta.layer_crc32) == shape.num_layers and back.fingerprint == FINGERPRINT
    for layer in range(shape.num_layers):
        k, v = back.layer(layer)
        assert k.dtype == torch.float16
        assert torch.equal(k, kv.keys[layer].half()) and torch.equal(v, kv.values[layer].half())
        assert torch.equal(k, encoded.layer(layer)[0])  # what a RAM tier keeps is what the bytes hold


def test_a_flipped_layer_byte_names_the_layer(shape, make_kv):
    data = bytearray(encode(KEY, make_kv(n=8), FINGERPRINT, shape, torch.float16).data())
    header = int.from_bytes(data[:8], "little")
    offsets = json.loads(data[8 : 8 + header])[layer_tensor_names(2)[1]]["data_offsets"]
    data[8 + header + (offsets[0] + offsets[1]) // 2] ^= 0xFF
    with pytest.raises(InvalidKVFile, match="layer 2 checksum"):
        decode(bytes(data), KEY)


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda data: data[:5], "truncated"),
        (lambda data: data[: len(data) // 2], "unreadable"),
        (lambda data: b"\x00" * 16, "truncated header|unreadable"),
    ],
)
def test_broken_bytes_are_refused(shape, make_kv, mangle, message):
    data = encode(KEY, make_kv(n=8), FINGERPRINT, shape, torch.float16).data()
    with pytest.raises(InvalidKVFile, match=message):
        decode(mangle(data), KEY)


def test_bytes_under_another_key_or_of_another_model_are_refused(shape, make_kv):
    data = encode(KEY, make_kv(n=8), FINGERPRINT, shape, torch.float16).data()
    with pytest.raises(InvalidKVFile, match="not the key it is stored under"):
        decode(data, chunk_key(FINGERPRINT, "float16", [9]))
    with pytest.raises(StoreError, match="cannot go into the store of model"):
        encode(KEY, make_kv(n=8, fingerprint="c" * 64), FINGERPRINT, shape, torch.float16)
