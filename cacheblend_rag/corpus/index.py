"""FAISS vector index over chunk embeddings: exact inner product by default, IVF or HNSW for large corpora.

Vectors are unit length, so inner product is cosine similarity. FAISS ids are the chunk rows' integer ids
in the corpus database. Indexes are saved with faiss' own writer, atomically (temp file + rename).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from ..errors import StoreError

INDEX_TYPES = ("flat", "ivf", "hnsw")
_HNSW_NEIGHBOURS = 32
_HNSW_EF_SEARCH = 128
_IVF_MIN_POINTS_PER_LIST = 39  # faiss' own floor for k-means training
_IVF_MAX_PROBE = 32


def check_index_type(kind: str) -> str:
    if kind not in INDEX_TYPES:
        raise ValueError(f"unknown index type {kind!r}: use one of {', '.join(INDEX_TYPES)}")
    return kind


def build_index(vectors: np.ndarray, ids: np.ndarray, kind: str = "flat", dim: int | None = None):
    """A FAISS index holding ``vectors`` [n, dim] (float32, unit rows) under int64 ``ids``."""
    import faiss

    check_index_type(kind)
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    dim = dim if dim is not None else vectors.shape[1]
    if vectors.shape != (len(ids), dim):
        raise ValueError(f"expected {len(ids)} vectors of dimension {dim}, got shape {vectors.shape}")
    if kind == "ivf":
        # k-means needs ~39 points per list; small corpora get few lists (1 list == exact search)
        nlist = max(1, min(int(4 * math.sqrt(len(ids))), len(ids) // _IVF_MIN_POINTS_PER_LIST))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
        if len(ids):
            index.train(vectors)
        index.nprobe = min(nlist, _IVF_MAX_PROBE)
    elif kind == "hnsw":
        index = faiss.IndexIDMap2(faiss.IndexHNSWFlat(dim, _HNSW_NEIGHBOURS, faiss.METRIC_INNER_PRODUCT))
    else:
        index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
    if len(ids):
        index.add_with_ids(vectors, ids)
    return index


def add_vectors(index, vectors: np.ndarray, ids: np.ndarray) -> None:
    """Append vectors to a flat or HNSW index built by :func:`build_index`."""
    index.add_with_ids(
        np.ascontiguousarray(vectors, dtype=np.float32), np.ascontiguousarray(ids, dtype=np.int64)
    )


def remove_vectors(index, ids: np.ndarray) -> None:
    """Remove the vectors with these ids from a flat or IVF index (HNSW cannot remove: rebuild it)."""
    import faiss

    index.remove_ids(faiss.IDSelectorBatch(np.ascontiguousarray(ids, dtype=np.int64)))


def search(
    index, query: np.ndarray, top_k: int, allowed: np.ndarray | None = None
) -> list[tuple[int, float]]:
    """The ``top_k`` nearest (id, score) pairs for one unit-length query vector, best first; with
    ``allowed``, among those ids only (FAISS skips every other vector during the search)."""
    import faiss

    limit = index.ntotal if allowed is None else min(index.ntotal, len(allowed))
    if limit == 0 or top_k <= 0:
        return []
    k = min(top_k, limit)
    _tune_for(index, k)
    params = None
    if allowed is not None:
        selector = faiss.IDSelectorBatch(np.ascontiguousarray(allowed, dtype=np.int64))
        params = _search_parameters(index, selector)
    scores, ids = index.search(np.ascontiguousarray(query, dtype=np.float32).reshape(1, -1), k, params=params)
    return [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if i >= 0]


def _search_parameters(index, selector):
    """Search parameters carrying ``selector`` of the kind ``index`` takes (its own tuning kept)."""
    import faiss

    inner = faiss.downcast_index(index.index) if isinstance(index, faiss.IndexIDMap2) else index
    if isinstance(inner, faiss.IndexHNSW):
        return faiss.SearchParametersHNSW(sel=selector, efSearch=inner.hnsw.efSearch)
    if isinstance(inner, faiss.IndexIVF):
        return faiss.SearchParametersIVF(sel=selector, nprobe=inner.nprobe)
    return faiss.SearchParameters(sel=selector)


def write_index(index, path: Path) -> None:
    """Save with faiss' writer to a temp file in the same folder, fsync, then rename over ``path``."""
    import faiss

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        faiss.write_index(index, str(tmp))
        tmp.chmod(0o644)  # faiss creates the file with the umask's mode, which may be world-writable
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_index(path: Path):
    import faiss

    try:
        return faiss.read_index(str(path))
    except RuntimeError as exc:
        raise StoreError(f"{path}: cannot read FAISS index: {exc}") from exc


def _tune_for(index, k: int) -> None:
    import faiss

    inner = faiss.downcast_index(index.index) if isinstance(index, faiss.IndexIDMap2) else index
    if isinstance(inner, faiss.IndexHNSW):
        inner.hnsw.efSearch = max(_HNSW_EF_SEARCH, k)
