"""One :class:`~cacheblend_rag.corpus.Corpus` per corpus directory in the process: every prompt frontend,
retriever and vector store over a directory reads the same opened corpus.

Holders with a ``close()`` (prompt frontends, vector store collections) take it with :func:`acquire_corpus`
and give it back with :func:`release_corpus`; the last one closes it (its database, index and KV store).
:func:`get_corpus` is for callers with nothing to close (the retrievers): the process keeps the corpus it
hands them open, as before.
"""

from __future__ import annotations

import threading
from pathlib import Path

from ..config import DEFAULTS, Config
from ..corpus.corpus import Corpus
from ..corpus.embedder import EmbedderLike
from ..models.registry import SharedRegistry
from ..store.shared import KVStoreOptions

_corpora: SharedRegistry[str, Corpus] = SharedRegistry(close=Corpus.close)
# the corpora get_corpus handed out, each held once for the rest of the process
_process_held: dict[str, Corpus] = {}
_process_lock = threading.Lock()


def corpus_key(corpus_dir: str | Path) -> str:
    """The key a corpus directory is shared under: its resolved path."""
    return str(Path(corpus_dir).expanduser().resolve())


def acquire_corpus(
    corpus_dir: str | Path, embedder: EmbedderLike | None = None, config: Config = DEFAULTS
) -> Corpus:
    """The process-wide :class:`Corpus` of a corpus directory, one more reference to it (pair with
    :func:`release_corpus`). ``embedder``: the one the corpus was built with (checked), for a corpus built
    with an external one; ``config``: the caller's settings, whose KV store options the first opener's
    corpus keeps. A corpus closed by hand is opened again."""
    key = corpus_key(corpus_dir)
    opened: list[Corpus] = []

    def open_() -> Corpus:
        opened.append(Corpus.open(key, embedder, KVStoreOptions.of(config)))
        return opened[0]

    corpus = _corpora.acquire(key, open_, usable=lambda c: not c.db.closed)
    if embedder is not None and not opened:
        try:
            corpus.use_embedder(embedder)
        except BaseException:
            _corpora.release(corpus)
            raise
    return corpus


def release_corpus(corpus: Corpus) -> None:
    """Give back one reference taken by :func:`acquire_corpus`; the last one closes the corpus."""
    _corpora.release(corpus)


def get_corpus(
    corpus_dir: str | Path, embedder: EmbedderLike | None = None, config: Config = DEFAULTS
) -> Corpus:
    """The process-wide :class:`Corpus` of a corpus directory for a caller that holds nothing (a retriever:
    no model is loaded), kept open by the process from then on. Arguments as :func:`acquire_corpus`."""
    key = corpus_key(corpus_dir)
    with _process_lock:
        corpus = acquire_corpus(key, embedder, config)
        if _process_held.get(key) is corpus:
            _corpora.release(corpus)  # the process holds it already: one reference is enough
        else:
            _process_held[key] = corpus
        return corpus


def shared_corpora() -> dict[str, int]:
    """Corpus directory -> references, of the corpora the process holds now."""
    return _corpora.references()
