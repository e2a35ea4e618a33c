"""One loaded model per (model, device, dtype) in a process, shared by every engine that asks for it.

:func:`acquire_model` loads a model on first use and hands the same :class:`LayerwiseModel` to every later
caller; :func:`release_model` gives one reference back, and the last one drops the process's hold on the
weights (they are freed once no engine keeps the object). Engines acquire the model they load by name and
release it on ``close()``; a model passed in as an object is the caller's to manage.

:class:`Shared` is the reference-counted registry behind it, also used for the chunk KV stores
(:mod:`cacheblend_rag.store.shared`): one object per key in a process, opened by its first holder.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from ..config import DEFAULTS, Config
from .loader import load_model, pick_device, pick_dtype
from .provision import resolve_model_path
from .runtime import LayerwiseModel

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class _Held(Generic[V]):
    value: V
    references: int


class Shared(Generic[K, V]):
    """Objects held by reference count, one per key: :meth:`acquire` opens the object on first use (under
    the registry's lock, so a second caller waits for the first open instead of opening again) and
    :meth:`release` gives one reference back; the last one forgets the object and returns True (the
    caller then closes it)."""

    def __init__(self) -> None:
        self._held: dict[K, _Held[V]] = {}
        self._lock = threading.Lock()

    def acquire(self, key: K, open_: Callable[[], V], usable: Callable[[V], bool] = lambda v: True) -> V:
        """The object held under ``key`` (``open_()`` on first use, or when ``usable`` says the one held
        can no longer serve, e.g. closed by hand); one more reference to it."""
        with self._lock:
            held = self._held.get(key)
            if held is None or not usable(held.value):
                held = self._held[key] = _Held(open_(), 0)
            held.references += 1
            return held.value

    def release(self, value: V) -> bool:
        """Give back one reference to ``value``; True when it was the last (the object is forgotten)."""
        with self._lock:
            for key, held in self._held.items():
                if held.value is value:
                    held.references -= 1
                    if held.references <= 0:
                        del self._held[key]
                        return True
                    return False
        return False

    def references(self) -> dict[K, int]:
        """Key -> references, of the objects held now."""
        with self._lock:
            return {key: held.references for key, held in self._held.items()}


_models: Shared[tuple[str, str, str], LayerwiseModel] = Shared()


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
    return _models.acquire(key, lambda: load_model(key[0], device, dtype, config))


def release_model(model: LayerwiseModel) -> None:
    """Give back one reference taken by :func:`acquire_model`; the last one forgets the model."""
    _models.release(model)


def shared_models() -> dict[tuple[str, str, str], int]:
    """(model folder, device, dtype) -> references, of the models the process holds now."""
    return _models.references()
