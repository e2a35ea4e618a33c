"""Command-line flags that override a setting for one command (``--kv-remote``).

The value goes through :func:`~cacheblend_rag.settings.override_settings`, so it also reaches the
processes a command starts (vLLM's engine and worker processes open their own KV store).
"""

from __future__ import annotations

import typer

from ..settings import override_settings

KV_REMOTE_ENV = "CACHEBLEND_KV_REMOTE"
KV_REMOTE_OPTION = typer.Option(
    "--kv-remote",
    help="Shared remote KV tier under RAM and local disk: redis://HOST:PORT/DB (Redis or Valkey). "
    f"Overrides ${KV_REMOTE_ENV}.",
)


def use_kv_remote(url: str | None) -> None:
    """``--kv-remote``: the remote KV tier's URL, checked here before anything is loaded (a malformed one
    raises :class:`~cacheblend_rag.errors.StoreError` naming the expected form)."""
    if url is None:
        return
    from ..store.remote.connection import split_url

    split_url(url)
    override_settings(kv_remote=url)
