"""One open :class:`~.kvstore.KVStore` per (root, model, codec) in a process, shared by every holder.

A corpus opens its chunk KV store through :func:`acquire_store` (:attr:`Corpus.kv_store
<cacheblend_rag.corpus.corpus.Corpus.kv_store>`), and so does an engine given a folder rather than a store:
two corpora or engines over one folder in a process hold the same store (one RAM tier, one background
writer, one index connection). :func:`release_store` gives one reference back; the last one closes
the store. The first holder's options (budgets, remote tier) are the store's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import Config
from ..models.registry import SharedRegistry
from ..models.runtime import ModelShape
from .keys import resolve_codec
from .kvstore import KVStore
from .remote import RedisKVTier


@dataclass(frozen=True)
class KVStoreOptions:
    """How a corpus opens its KV store besides the model and codec its manifest records: tier budgets and
    the shared remote tier, values the caller resolved (None: the store's default; remote None or '':
    none; :meth:`of` takes them from a configuration). ``kv_dtype``: the codec of a corpus made before
    codecs were recorded."""

    ram_budget_bytes: int | None = None
    disk_budget_bytes: int | None = None
    remote: RedisKVTier | str | None = None
    kv_dtype: str | None = None

    @classmethod
    def of(cls, config: Config) -> KVStoreOptions:
        """The budgets, remote tier and codec ``config`` names (the edges pass their settings)."""
        return cls(config.ram_budget_bytes, config.disk_budget_bytes, config.kv_remote, config.kv_dtype)

    def store_kwargs(self) -> dict[str, Any]:
        """The options :class:`KVStore` takes, those given."""
        given = {
            "ram_budget_bytes": self.ram_budget_bytes,
            "disk_budget_bytes": self.disk_budget_bytes,
            "remote": self.remote,
        }
        return {name: value for name, value in given.items() if value is not None}


_stores: SharedRegistry[tuple[str, str, str], KVStore] = SharedRegistry(close=KVStore.close)


def acquire_store(
    root: str | Path,
    model_fingerprint: str,
    shape: ModelShape,
    kv_dtype: torch.dtype | str,
    **options: Any,
) -> KVStore:
    """The process's open store at ``root`` for this model and codec (``kv_dtype``), opened on first use
    with ``options`` (:class:`KVStore`'s keyword arguments). Pair every call with
    :func:`release_store`."""
    codec = resolve_codec(kv_dtype).name
    root = Path(root).expanduser()
    key = (str(root.resolve()), model_fingerprint, codec)
    return _stores.acquire(key, lambda: KVStore(root, model_fingerprint, shape, codec, **options), _usable)


def release_store(store: KVStore) -> None:
    """Give back one reference taken by :func:`acquire_store`; the last one closes the store."""
    _stores.release(store)


def shared_stores() -> dict[tuple[str, str, str], int]:
    """(root, model fingerprint, codec) -> references, of the stores the process holds open now."""
    return _stores.references()


def _usable(store: KVStore) -> bool:
    return not store.closed  # closed by hand (store.close()): open it again
