"""The sentence embedder: unit vectors, offline default model, long texts embedded whole."""

from __future__ import annotations

import numpy as np
import pytest

from cacheblend_rag.corpus.embedder import Embedder, get_embedder, resolve_embedder_path
from cacheblend_rag.errors import ModelNotFoundError


def test_unit_vectors_of_the_default_model(embedder):
    assert embedder.name == "all-MiniLM-L6-v2" and embedder.dim == 384
    vectors = embedder.embed(["Emilia Galotti is a play.", "", "x" * 5000])
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert embedder.embed([]).shape == (0, 384)
    assert get_embedder("sentence-transformers/all-MiniLM-L6-v2") is embedder


def test_the_end_of_a_long_text_counts(embedder):
    filler = "The committee met again on Tuesday and discussed the agenda. " * 40  # > one 256-piece window
    mongolia = filler + "The capital of Mongolia is Ulaanbaatar, the country's largest city."
    bananas = filler + "Bananas are rich in potassium and grow in tropical climates."
    query = embedder.embed_query("What is the capital of Mongolia?")
    scores = embedder.embed([mongolia, bananas]) @ query
    assert scores[0] > scores[1] + 0.02


def test_unknown_embedder_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="embedder 'no-such-model' not found"):
        resolve_embedder_path("no-such-model")
    with pytest.raises(ModelNotFoundError):
        Embedder(tmp_path)
