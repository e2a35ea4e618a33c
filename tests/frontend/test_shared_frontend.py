"""The process-wide prompt frontends: one per (corpus, model, engine kind, settings), held by reference
count, and never another holder's settings."""

from __future__ import annotations

from cacheblend_rag.config import Config
from cacheblend_rag.frontend import acquire_frontend, release_frontend, shared_frontends
from cacheblend_rag.settings import get_settings, settings_with


def holds(config: Config) -> int:
    """The holds on the corpus-less frontend of the default model shared with ``config``'s values."""
    return shared_frontends().get((None, None, config.engine, config.value_key()), 0)


def test_a_holder_with_other_settings_gets_a_frontend_built_with_them():
    settings = get_settings()
    other = settings_with(settings, batch_max_requests=3)
    first = acquire_frontend(config=settings)
    same_values = acquire_frontend(config=Config.model_validate(settings.model_dump()))
    second = acquire_frontend(config=other)
    try:
        assert same_values is first, "equal values share one frontend, whatever their class"
        assert second is not first, "other settings: a frontend of its own"
        assert first.config.batch_max_requests == settings.batch_max_requests != 3
        assert second.config.batch_max_requests == 3 and second.scheduler.max_batch == 3
        assert first.scheduler.max_batch == settings.batch_max_requests
        assert second.engine.model is first.engine.model, "the model's weights are still loaded once"
        assert (holds(settings), holds(other)) == (2, 1)
    finally:
        release_frontend(second)
        release_frontend(same_values)
    assert second.closed and not first.closed and holds(settings) == 1 and holds(other) == 0
    release_frontend(first)
    assert first.closed and holds(settings) == 0


def test_a_frontend_closed_by_hand_is_loaded_again():
    settings = get_settings()
    first = acquire_frontend(config=settings)
    first.close()
    again = acquire_frontend(config=settings)
    try:
        assert again is not first and not again.closed and again.scheduler is not None
        assert holds(settings) == 1
    finally:
        release_frontend(first)  # the closed one is no longer held: ignored
        assert holds(settings) == 1 and not again.closed
        release_frontend(again)
    assert again.closed and holds(settings) == 0
