"""One loaded model per (model, device, dtype) in a process, shared by every engine that asks for it.

:func:`acquire_model` loads a model on first use and hands the same :class:`LayerwiseModel` to every later
caller; :func:`release_model` gives one reference back, and the last one drops the process's hold on the
weights (they are freed once no engine keeps the object). Engines acquire the model they load by name and
release it on ``close()``; a model passed in as an object is the caller's to manage.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from ..settings import get_settings
from .loader import load_model, pick_device, pick_dtype
from .provision import resolve_model_path
from .runtime import LayerwiseModel


@dataclass
class _Held:
    model: LayerwiseModel
    references: int


_held: dict[tuple[str, str, str], _Held] = {}
_lock = threading.Lock()


def _key(model: str | Path | None, device: str | None, dtype: str | None) -> tuple[str, str, str]:
    settings = get_settings()
    dev = pick_device(device or settings.device)
    compute = pick_dtype(dtype or settings.compute_dtype, dev)
    return str(resolve_model_path(model).resolve()), str(dev), str(compute).removeprefix("torch.")


def acquire_model(
    model: str | Path | None = None, device: str | None = None, dtype: str | None = None
) -> LayerwiseModel:
    """The process's shared :class:`LayerwiseModel` for ``model`` (name or folder; default: the settings'
    model) on ``device`` in ``dtype``, loaded on first use. Pair every call with :func:`release_model`."""
    key = _key(model, device, dtype)
    with _lock:  # held while loading: a second caller waits for the first load instead of loading again
        held = _held.get(key)
        if held is None:
            held = _held[key] = _Held(load_model(key[0], device, dtype), 0)
        held.references += 1
        return held.model


def release_model(model: LayerwiseModel) -> None:
    """Give back one reference taken by :func:`acquire_model`; the last one forgets the model."""
    with _lock:
        for key, held in _held.items():
            if held.model is model:
                held.references -= 1
                if held.references <= 0:
                    del _held[key]
                return


def shared_models() -> dict[tuple[str, str, str], int]:
    """(model folder, device, dtype) -> references, of the models the process holds now."""
    with _lock:
        return {key: held.references for key, held in _held.items()}
