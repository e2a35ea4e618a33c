"""A corpus and the engine that answers over it, checked once to belong together: :class:`Session`.

Everything that answers over a corpus holds one, opened by :meth:`Session.open` (from a corpus directory,
or an opened corpus): :class:`~cacheblend_rag.rag.CacheBlendRAG`, and the prompt frontend, through which
the LangChain and LlamaIndex classes and the server answer. The model and chunk-context checks live here
and nowhere else, and so does re-pinning the corpus in a remote KV tier that lost it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

from ..blend.segments import ChunkContext
from ..config import DEFAULTS, Config
from ..corpus.corpus import Corpus
from ..corpus.pinning import pin_corpus
from ..errors import StoreError
from ..store.shared import KVStoreOptions
from . import create_engine
from .base import EngineProtocol, ModelIdentity

log = logging.getLogger(__name__)


class ChunkEngine(Protocol):
    """What :func:`check_engine_fits` reads of an engine (either engine, or ingest's KV writer)."""

    model: ModelIdentity
    chunk_context: ChunkContext


def check_engine_fits(
    where: str, fingerprint: str, chunk_context: ChunkContext, engine: ChunkEngine, model: str
) -> None:
    """Raise :class:`StoreError` unless ``engine`` runs the model (``fingerprint``, named ``model``) whose
    chunks corpus ``where`` (its directory) holds or is cut for, and prefills chunks behind the same
    ``chunk_context`` (part of every chunk's KV key: another one would never find the corpus's KV). The
    one check of an engine against a corpus: a :class:`Session` makes it, and ingest before its KV stage."""
    running = engine.model
    if fingerprint != running.fingerprint:
        raise StoreError(
            f"corpus {where} is for model {model!r} (fingerprint {fingerprint[:12]}…) but the engine "
            f"runs {running.name!r} ({running.fingerprint[:12]}…); use an engine over that model, or "
            "ingest into a new corpus directory for this one"
        )
    if chunk_context != engine.chunk_context:
        raise StoreError(
            f"corpus {where} precomputes chunk KV behind a {len(chunk_context)}-token chunk context, the "
            f"engine behind a {len(engine.chunk_context)}-token one; create the engine with "
            "chunk_context=Corpus.open(...).chunk_context (or re-run ingest to upgrade the corpus)"
        )


class Session:
    """``corpus`` and ``engine``, checked to belong together (:func:`check_engine_fits`): the engine runs
    the corpus's model and prefills chunks behind its chunk context. With a remote KV tier under the
    engine's store, the corpus is pinned there again when the tier comes back without it.

    ``owns_engine`` / ``owns_corpus``: :meth:`close` closes them (what :meth:`open` built is owned)."""

    def __init__(
        self, corpus: Corpus, engine: EngineProtocol, owns_engine: bool = False, owns_corpus: bool = False
    ) -> None:
        manifest = corpus.manifest
        check_engine_fits(
            str(corpus.corpus_dir), manifest.model_fingerprint, corpus.chunk_context, engine, manifest.model
        )
        self.corpus = corpus
        self.engine = engine
        self._owns_engine = owns_engine
        self._owns_corpus = owns_corpus
        remote = getattr(engine.store, "remote", None)
        if remote is not None:
            # a tier restarted without persistence lost the pins: put this corpus's back
            remote.on_pins_lost(self._repin)

    @classmethod
    def open(
        cls,
        corpus: Corpus | str | Path,
        engine_kind: str | None = None,
        model: str | Path | None = None,
        config: Config = DEFAULTS,
        owns_corpus: bool = False,
        engine: EngineProtocol | None = None,
    ) -> Session:
        """A session over ``corpus`` (an opened :class:`Corpus`, or the directory of one, opened here with
        ``config``'s KV store options and owned) with ``engine``, or an engine built for it (owned:
        :meth:`close` closes it) of ``engine_kind`` ("torch" or "vllm", default ``config.engine``), over
        ``model`` (default: the corpus's), on the corpus's KV store and chunk context, with ``config``'s
        values. What was opened here is closed again if the two do not belong together."""
        opened = not isinstance(corpus, Corpus)
        if not isinstance(corpus, Corpus):
            corpus, owns_corpus = Corpus.open(corpus, kv_options=KVStoreOptions.of(config)), True
        built = engine is None
        try:
            if engine is None:
                engine = create_engine(
                    engine_kind or config.engine,
                    model or corpus.model_source,
                    store=corpus.kv_store,
                    chunk_context=corpus.chunk_context,
                    config=config,
                )
            try:
                return cls(corpus, engine, owns_engine=built, owns_corpus=owns_corpus)
            except BaseException:
                if built:
                    engine.close()
                raise
        except BaseException:
            if opened:
                corpus.close()
            raise

    def _repin(self) -> None:
        try:
            pinned = pin_corpus(self.corpus, self.engine.store)
        except Exception as exc:  # a background thread's failure is logged, never raised into a request
            log.warning("re-pinning corpus %s in the remote KV tier failed: %s", self.corpus.corpus_dir, exc)
            return
        log.warning("re-pinned %d chunks of corpus %s in the remote KV tier", pinned, self.corpus.corpus_dir)

    def close(self) -> None:
        """Close the engine the session owns (its hold on the shared model) and the corpus it owns (its
        hold on the corpus's KV store: the last holder in the process closes it). Idempotent."""
        if self._owns_engine:
            self._owns_engine = False
            self.engine.close()
        if self._owns_corpus:
            self._owns_corpus = False
            self.corpus.close()
