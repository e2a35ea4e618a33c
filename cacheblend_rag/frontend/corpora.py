"""One :class:`~cacheblend_rag.corpus.Corpus` per corpus directory in the process (:func:`get_corpus`):
every prompt frontend, retriever and vector store over a directory reads the same opened corpus."""

from __future__ import annotations

import threading
from pathlib import Path

from ..config import DEFAULTS, Config
from ..corpus.corpus import Corpus
from ..corpus.embedder import EmbedderLike
from ..store.shared import KVStoreOptions

_corpora: dict[str, Corpus] = {}
_corpora_lock = threading.Lock()


def corpus_key(corpus_dir: str | Path) -> str:
    """The key a corpus directory is shared under: its resolved path."""
    return str(Path(corpus_dir).expanduser().resolve())


def get_corpus(
    corpus_dir: str | Path, embedder: EmbedderLike | None = None, config: Config = DEFAULTS
) -> Corpus:
    """The process-wide :class:`Corpus` of a corpus directory (for retrievers: no model is loaded).
    ``embedder``: the one the corpus was built with (checked), for a corpus built with an external one;
    ``config``: the caller's settings, whose KV store options the first opener's corpus keeps."""
    key = corpus_key(corpus_dir)
    with _corpora_lock:
        corpus = _corpora.get(key)
        if corpus is None:
            corpus = _corpora[key] = Corpus.open(key, embedder, KVStoreOptions.of(config))
        elif embedder is not None:
            corpus.use_embedder(embedder)
        return corpus
