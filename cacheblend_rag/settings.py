"""The package's settings, read from the environment (prefix ``CACHEBLEND_``): read by the edges only.

:class:`Settings` is a :class:`~cacheblend_rag.config.Config` (the typed, bounded runtime values, with
their defaults) loaded from ``CACHEBLEND_<FIELD>`` variables. The CLI, :class:`~cacheblend_rag.rag.
CacheBlendRAG`, the integrations, the server and eval read it and pass it (or values from it) down; the
core packages never import this module (an import-linter contract in pyproject.toml keeps it so). A bad
value (``CACHEBLEND_RATIO=15``, ``CACHEBLEND_ENGINE=vlm``) fails when the settings are loaded, with a
:class:`SettingsError` naming the variable, the value and what it accepts.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from .config import DEFAULT_MODEL, Config

__all__ = [
    "DEFAULT_MODEL",
    "ENV_PREFIX",
    "Settings",
    "SettingsError",
    "describe_settings_error",
    "get_settings",
    "settings_with",
]

ENV_PREFIX = "CACHEBLEND_"


class Settings(BaseSettings, Config):
    """Runtime configuration. Every field can be set as ``CACHEBLEND_<FIELD>`` in the environment."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)


class SettingsError(ValueError):
    """A setting (an environment variable ``CACHEBLEND_<FIELD>``) has a value it does not accept."""


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Process-wide settings (cached; call ``get_settings.cache_clear()`` after changing the environment).
    Raises :class:`SettingsError` naming every bad variable."""
    try:
        return Settings()
    except ValidationError as exc:
        raise SettingsError(describe_settings_error(exc)) from None


def describe_settings_error(exc: ValidationError) -> str:
    """One line per bad field: the variable, the value given and what it accepts."""
    problems = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else "?"
        problems.append(f"{ENV_PREFIX}{field.upper()}={error.get('input')!r}: {error['msg']}")
    return "invalid setting" + ("s" if len(problems) > 1 else "") + ": " + "; ".join(problems)


def settings_with(base: Settings | None = None, **values: Any) -> Settings:
    """``base`` (default: the process's settings) with ``values`` in place of its own, each checked as the
    environment's would be (what a command-line flag such as ``--kv-remote`` does for one command). The
    environment and the process's settings are left as they are: the caller passes the result down (to
    vLLM's engine and worker processes through the connector's configuration). A bad name or value
    raises ``ValueError`` and changes nothing (a bad value raises :class:`SettingsError`)."""
    unknown = sorted(set(values) - set(Settings.model_fields))
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(unknown)}")
    if any(value is None for value in values.values()):
        raise ValueError("a setting cannot be overridden with None")
    base = get_settings() if base is None else base
    try:
        # validated as Config: a Settings() would read the environment again
        checked = Config.model_validate({**base.model_dump(), **values})
    except ValidationError as exc:
        raise SettingsError(describe_settings_error(exc)) from None
    return base.model_copy(update={name: getattr(checked, name) for name in values})
