"""Chunk keys and storage cost."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from cacheblend_rag.eval.bench.store import storage_cost
from cacheblend_rag.store.keys import chunk_key, is_chunk_key, kv_bytes_per_token, resolve_kv_dtype

FP = "f" * 64


def test_key_depends_on_model_dtype_and_tokens():
    base = chunk_key(FP, "float16", [1, 2, 3])
    # the documented derivation, byte for byte: a change would orphan every chunk KV stored so far
    header = "\0".join(("cacheblend-kv", FP, "float16", "v1", "n=3")) + "\0"
    expected = hashlib.sha256(header.encode() + np.asarray([1, 2, 3], dtype="<i8").tobytes()).hexdigest()
    assert base == expected and is_chunk_key(base)
    assert chunk_key(FP, torch.float16, (1, 2, 3)) == base
    assert chunk_key(FP, "fp16", range(1, 4)) == base
    others = {
        chunk_key("e" * 64, "float16", [1, 2, 3]),
        chunk_key(FP, "bfloat16", [1, 2, 3]),
        chunk_key(FP, "float32", [1, 2, 3]),
        chunk_key(FP, "float16", [1, 2, 4]),
        chunk_key(FP, "float16", [1, 2]),
        chunk_key(FP, "float16", [3, 2, 1]),
    }
    assert base not in others and len(others) == 6


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", "float16", [1]), "fingerprint"),
        ((FP, "float16", []), "non-empty"),
        ((FP, "float16", [1, -2]), "non-negative"),
        ((FP, "int3", [1]), "unsupported KV storage dtype"),
        ((FP, torch.int64, [1]), "unsupported KV storage dtype"),
    ],
)
def test_key_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        chunk_key(*args)


def test_dtype_names():
    assert resolve_kv_dtype("bf16") is torch.bfloat16 and resolve_kv_dtype("torch.float32") is torch.float32


def test_storage_cost_of_the_default_model(model):
    assert kv_bytes_per_token(model.shape, torch.float16) == 23_040
    assert kv_bytes_per_token(model.shape, torch.bfloat16) == 23_040
    assert kv_bytes_per_token(model.shape, torch.float32) == 46_080
    cost = storage_cost(model.shape, 512)
    assert cost["float16"].payload_bytes == cost["bfloat16"].payload_bytes == 11_796_480
    assert cost["float32"].payload_bytes == 23_592_960
    for row in cost.values():  # the header (tensor table, checksums) is small
        assert row.payload_bytes < row.file_bytes < row.payload_bytes + 16_384
