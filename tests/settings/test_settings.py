"""Settings are typed and bounded: a bad CACHEBLEND_* value fails at load, naming the variable, from
get_settings() and from every CLI command."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from cacheblend_rag.blend import CacheBlend
from cacheblend_rag.cli import app
from cacheblend_rag.config import DEFAULTS, Config
from cacheblend_rag.settings import SettingsError, get_settings, settings_with


@pytest.fixture(autouse=True)
def _fresh_settings():
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.mark.parametrize(
    "variable, value, says",
    [
        ("CACHEBLEND_RATIO", "15", "less than or equal to 1"),
        ("CACHEBLEND_ENGINE", "vlm", "'torch' or 'vllm'"),
        ("CACHEBLEND_INDEX_TYPE", "annoy", "'flat', 'ivf' or 'hnsw'"),
        ("CACHEBLEND_KV_DTYPE", "int3", "'float32', 'int8' or 'int4'"),
        ("CACHEBLEND_TOP_K", "0", "greater than or equal to 1"),
        ("CACHEBLEND_CHUNK_TOKENS", "8", "greater than or equal to 16"),
        ("CACHEBLEND_DEVICE", "gpu", "should match pattern"),
        ("CACHEBLEND_KV_REMOTE", "http://cache:6379", "should match pattern"),
        ("CACHEBLEND_THREADS", "many", "valid integer"),
    ],
)
def test_a_bad_value_fails_at_load_naming_the_variable(monkeypatch, variable, value, says):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as caught:
        get_settings()
    assert f"{variable}={value!r}" in str(caught.value) and says in str(caught.value)
    result = CliRunner().invoke(app, ["store", "stats", "--corpus", "/nonexistent"])
    assert result.exit_code == 2 and variable in result.output and "Traceback" not in result.output


def test_every_bad_variable_is_named_at_once(monkeypatch):
    monkeypatch.setenv("CACHEBLEND_RATIO", "-0.5")
    monkeypatch.setenv("CACHEBLEND_ENGINE", "tensorrt")
    with pytest.raises(SettingsError, match=r"CACHEBLEND_ENGINE=.*; CACHEBLEND_RATIO="):
        get_settings()


def test_good_values_load(monkeypatch):
    for variable, value in {
        "CACHEBLEND_RATIO": "0.3",
        "CACHEBLEND_ENGINE": "vllm",
        "CACHEBLEND_DEVICE": "cuda:1",
        "CACHEBLEND_KV_REMOTE": "redis://localhost:6379/0",
        "CACHEBLEND_INDEX_TYPE": "hnsw",
    }.items():
        monkeypatch.setenv(variable, value)
    settings = get_settings()
    assert (settings.ratio, settings.engine, settings.device, settings.index_type) == (
        0.3,
        "vllm",
        "cuda:1",
        "hnsw",
    )


def test_a_setting_overridden_for_one_command_leaves_the_environment_alone(monkeypatch, tmp_path):
    monkeypatch.delenv("CACHEBLEND_KV_REMOTE", raising=False)
    monkeypatch.setenv("CACHEBLEND_RATIO", "0.3")
    before = get_settings()
    changed = settings_with(kv_remote="redis://localhost:6379/0")
    assert (changed.kv_remote, changed.ratio) == ("redis://localhost:6379/0", 0.3)  # the rest is the base's
    assert get_settings() is before and before.kv_remote is None
    assert "CACHEBLEND_KV_REMOTE" not in os.environ
    with pytest.raises(SettingsError, match="CACHEBLEND_KV_REMOTE='http://cache'"):
        settings_with(kv_remote="http://cache")
    with pytest.raises(ValueError, match="unknown setting"):
        settings_with(colour="blue")
    # a command's --kv-remote (the store it names does not exist: the command fails after reading it)
    result = CliRunner().invoke(
        app, ["store", "stats", "--corpus", str(tmp_path), "--kv-remote", "redis://localhost:1/0"]
    )
    assert result.exit_code == 1 and "no KV store" in result.output
    assert "CACHEBLEND_KV_REMOTE" not in os.environ and get_settings().kv_remote is None


def test_the_core_defaults_are_the_settings_defaults(monkeypatch):
    """One default per concept: an unset variable gives the value a core constructor uses by default."""
    for name in Config.model_fields:
        monkeypatch.delenv(f"CACHEBLEND_{name.upper()}", raising=False)
    get_settings.cache_clear()
    assert get_settings().model_dump() == DEFAULTS.model_dump()
    assert CacheBlend().ratio == DEFAULTS.ratio == get_settings().ratio
