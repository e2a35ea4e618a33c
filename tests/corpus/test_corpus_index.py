"""FAISS index helpers: every index type finds exact neighbours on small data, saves and loads atomically."""

from __future__ import annotations

import numpy as np
import pytest

from cacheblend_rag.corpus import index as vector_index
from cacheblend_rag.errors import StoreError


def unit_vectors(n: int, dim: int = 32, seed: int = 0) -> np.ndarray:
    vectors = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


@pytest.mark.parametrize("kind", vector_index.INDEX_TYPES)
def test_each_type_returns_the_nearest_ids(tmp_path, kind):
    vectors = unit_vectors(300)
    ids = np.arange(1000, 1300, dtype=np.int64)
    index = vector_index.build_index(vectors, ids, kind)
    for probe in (0, 17, 299):
        hits = vector_index.search(index, vectors[probe], 3)
        assert hits[0][0] == ids[probe] and hits[0][1] == pytest.approx(1.0, abs=1e-5)
        assert [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)
    path = tmp_path / "faiss.index"
    vector_index.write_index(index, path)
    loaded = vector_index.read_index(path)
    assert loaded.ntotal == 300
    assert vector_index.search(loaded, vectors[5], 1)[0][0] == 1005
    assert [p.name for p in tmp_path.iterdir()] == ["faiss.index"]  # no temp file left behind


def test_empty_index_and_bad_arguments(tmp_path):
    empty = vector_index.build_index(np.zeros((0, 8), np.float32), np.zeros(0, np.int64), "flat", dim=8)
    assert vector_index.search(empty, np.ones(8, np.float32), 5) == []
    with pytest.raises(ValueError, match="unknown index type"):
        vector_index.build_index(unit_vectors(4), np.arange(4), "lsh")
    with pytest.raises(ValueError, match="expected 3 vectors"):
        vector_index.build_index(unit_vectors(4), np.arange(3), "flat")


def test_flat_index_can_grow(tmp_path):
    vectors = unit_vectors(20)
    index = vector_index.build_index(vectors[:10], np.arange(10), "flat")
    vector_index.add_vectors(index, vectors[10:], np.arange(10, 20))
    assert vector_index.search(index, vectors[15], 1)[0][0] == 15


def test_corrupt_index_file_is_a_store_error(tmp_path):
    path = tmp_path / "faiss.index"
    path.write_bytes(b"garbage, not an index")
    with pytest.raises(StoreError, match="cannot read FAISS index"):
        vector_index.read_index(path)
