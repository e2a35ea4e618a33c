"""Command-line flags that override a setting for one command (``--kv-remote``).

:func:`use_kv_remote` returns the command's settings: the process's, with the flag's value in place
(:func:`~cacheblend_rag.settings.settings_with`; the environment is left as it is). The command passes
them down, and vLLM's engine and worker processes get the remote tier's URL through the KV connector's
configuration.
"""

from __future__ import annotations

import typer

from ..settings import Settings, get_settings, settings_with

KV_REMOTE_ENV = "CACHEBLEND_KV_REMOTE"
KV_REMOTE_OPTION = typer.Option(
    "--kv-remote",
    help="Shared remote KV tier under RAM and local disk: redis://HOST:PORT/DB (Redis or Valkey). "
    f"Overrides ${KV_REMOTE_ENV}.",
)


def use_kv_remote(url: str | None) -> Settings:
    """The command's settings, with ``--kv-remote``'s URL when given, checked here before anything is
    loaded (a malformed one raises :class:`~cacheblend_rag.errors.StoreError` naming the expected
    form)."""
    if url is None:
        return get_settings()
    from ..store.remote.connection import split_url

    split_url(url)
    return settings_with(kv_remote=url)
