"""One :class:`~.prompt_frontend.PromptFrontend`, so one engine, per (corpus, model, engine kind, settings)
in the process (a :class:`~cacheblend_rag.models.registry.SharedRegistry`): every LLM, chat model,
retriever and vector store object over a corpus uses the same model and the same corpus (:mod:`.corpora`),
and a holder passing other settings gets an engine of its own, built with them. Engines over different
corpora share the model's weights too (:func:`cacheblend_rag.models.shared.acquire_model`).

A frontend taken with :func:`acquire_frontend` is given back by its holder (an integration object's
``close()``) with :func:`release_frontend`; the last release closes it and frees the model.
:func:`get_frontend` is for callers with nothing to close: the process keeps it.
"""

from __future__ import annotations

from pathlib import Path

from ..config import DEFAULTS, Config
from ..engine import ENGINE_KINDS
from ..models.registry import SharedRegistry
from .corpora import corpus_key
from .prompt_frontend import PromptFrontend

# (corpus directory, model, engine kind, the configuration's values): a holder with other settings gets
# a frontend of its own (its engine built with its values), never another holder's
_FrontendKey = tuple[str | None, str | None, str, tuple[tuple[str, object], ...]]
_frontends: SharedRegistry[_FrontendKey, PromptFrontend] = SharedRegistry(close=PromptFrontend.close)


def _frontend_key(
    corpus_dir: str | Path | None, model: str | Path | None, engine_kind: str | None, config: Config
) -> _FrontendKey:
    kind = engine_kind or config.engine
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown engine {kind!r}; available: {', '.join(ENGINE_KINDS)}")
    directory = corpus_key(corpus_dir) if corpus_dir is not None else None
    return (directory, str(model) if model else None, kind, config.value_key())


def acquire_frontend(
    corpus_dir: str | Path | None = None,
    model: str | Path | None = None,
    engine_kind: str | None = None,
    config: Config = DEFAULTS,
) -> PromptFrontend:
    """The process-wide :class:`PromptFrontend` for (corpus, model, engine kind, configuration), loaded
    on first use; give it back with :func:`release_frontend`. ``engine_kind``: "torch" or "vllm" (default:
    ``config.engine``); ``config``: the caller's settings, part of the key by value (every edge passes the
    process's, so every holder shares one engine, as a retriever, a chat model and an LLM object over one
    corpus do; a holder with other values gets a frontend built with them)."""
    key = _frontend_key(corpus_dir, model, engine_kind, config)
    return _frontends.acquire(
        key, lambda: PromptFrontend(key[0], model, engine_kind=key[2], config=config), _usable
    )


def release_frontend(frontend: PromptFrontend) -> None:
    """Give back one hold on ``frontend``; the last one closes it (and gives its model back)."""
    _frontends.release(frontend)


def shared_frontends() -> dict[_FrontendKey, int]:
    """(corpus directory, model, engine kind, configuration values) -> holds, of the frontends shared now."""
    return _frontends.references()


def _usable(frontend: PromptFrontend) -> bool:
    return not frontend.closed  # closed by hand (frontend.close()): load it again


def get_frontend(
    corpus_dir: str | Path | None = None,
    model: str | Path | None = None,
    engine_kind: str | None = None,
    config: Config = DEFAULTS,
) -> PromptFrontend:
    """The process-wide :class:`PromptFrontend` for (corpus, model, engine kind, configuration), kept for
    the rest of the process (``config``: as for :func:`acquire_frontend`)."""
    return acquire_frontend(corpus_dir, model, engine_kind, config)
