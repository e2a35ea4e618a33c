"""One loaded model per (model, device, dtype) in a process, shared by every engine that asks for it.

:func:`acquire_model` loads a model on first use and hands the same :class:`LayerwiseModel` to every later
caller; :func:`release_model` gives one reference back, and the last one drops the process's hold on the
weights (they are freed once no engine keeps the object). Engines acquire the model they load by name and
release it on ``close()``; a model passed in as an object is the caller's to manage.

The key is everything the loaded object depends on: the resolved model folder (``config.home`` only helps
find it), the device and the compute dtype. ``config.threads`` is not part of the model but of the
process (torch's intra-op threads, which a load sets): a caller asking for other threads than a shared
model runs with is told so in a warning and shares the model as it runs (a second copy of the weights
would not give it other threads).

The reference counting is :class:`~.registry.SharedRegistry`'s (the chunk KV stores and the prompt
frontends are shared the same way).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ..config import DEFAULTS, Config
from .loader import load_model, pick_device, pick_dtype
from .provision import resolve_model_path
from .registry import SharedRegistry
from .runtime import LayerwiseModel

log = logging.getLogger(__name__)

_models: SharedRegistry[tuple[str, str, str], LayerwiseModel] = SharedRegistry()  # forgets, never closes


def _key(
    model: str | Path | None, device: str | None, dtype: str | None, config: Config
) -> tuple[str, str, str]:
    dev = pick_device(device or config.device)
    compute = pick_dtype(dtype or config.compute_dtype, dev)
    return (
        str(resolve_model_path(model, config.home).resolve()),
        str(dev),
        str(compute).removeprefix("torch."),
    )


def acquire_model(
    model: str | Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    config: Config = DEFAULTS,
) -> LayerwiseModel:
    """The process's shared :class:`LayerwiseModel` for ``model`` (name or folder; default: the default
    model) on ``device`` in ``dtype`` (default: ``config``'s), loaded on first use (see :func:`load_model`
    for what ``config`` gives). Pair every call with :func:`release_model`."""
    key = _key(model, device, dtype, config)
    loaded: list[LayerwiseModel] = []

    def load() -> LayerwiseModel:
        loaded.append(load_model(key[0], device, dtype, config))
        return loaded[0]

    shared = _models.acquire(key, load)
    wanted, running = config.threads or os.cpu_count() or 1, torch.get_num_threads()
    if not loaded and wanted != running:
        log.warning(
            "the shared model %s (%s, %s) runs with %d torch threads, not the %d asked for (threads=%d): "
            "threads are process-wide, set by the first load",
            shared.name,
            key[1],
            key[2],
            running,
            wanted,
            config.threads,
        )
    return shared


def release_model(model: LayerwiseModel) -> None:
    """Give back one reference taken by :func:`acquire_model`; the last one forgets the model."""
    _models.release(model)


def shared_models() -> dict[tuple[str, str, str], int]:
    """(model folder, device, dtype) -> references, of the models the process holds now."""
    return _models.references()
