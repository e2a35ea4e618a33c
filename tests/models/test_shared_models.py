"""The process-wide models: one per what the loaded object depends on (model folder, device, dtype), and
a caller asking for other torch threads than the shared model runs with is told, not silently ignored."""

from __future__ import annotations

import logging

import torch

from cacheblend_rag.models.provision import resolve_model_path
from cacheblend_rag.models.shared import acquire_model, release_model, shared_models
from cacheblend_rag.settings import get_settings, settings_with


def test_the_key_is_what_the_model_was_loaded_as_and_other_threads_are_told(caplog):
    settings = get_settings()
    first = acquire_model(config=settings)
    try:
        folder = str(resolve_model_path(None, settings.home).resolve())
        key = (folder, str(first.device), str(first.dtype).removeprefix("torch."))
        assert shared_models()[key] >= 1, "keyed by the loaded object's folder, device and dtype"
        running = torch.get_num_threads()
        other = settings_with(settings, threads=running + 1)
        # (the first acquire may have been told too: an earlier test in this process can have loaded the
        # shared model with other threads)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="cacheblend_rag.models.shared"):
            same = acquire_model(config=other)
        try:
            assert same is first, "threads do not make another copy of the weights"
            assert torch.get_num_threads() == running, "nor do they change the process's threads"
            (warning,) = [r.getMessage() for r in caplog.records]
            assert f"runs with {running} torch threads, not the {running + 1} asked for" in warning
        finally:
            release_model(same)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="cacheblend_rag.models.shared"):
            again = acquire_model(config=settings_with(settings, threads=running))
        release_model(again)
        assert again is first and not caplog.records, "the threads it runs with: nothing to say"
        half = acquire_model(dtype="bfloat16", config=settings)
        try:
            assert half is not first and half.dtype == torch.bfloat16, "another dtype is another model"
            assert shared_models()[(folder, key[1], "bfloat16")] == 1
        finally:
            release_model(half)
    finally:
        release_model(first)
