"""``cacheblend-rag models``: info on the default model, and a clear exit on a missing one."""

from __future__ import annotations

from typer.testing import CliRunner

from cacheblend_rag.cli import app


def run_cli(*args: str):
    result = CliRunner().invoke(app, list(args))
    return result, " ".join(result.output.split())  # Rich wraps long lines at the terminal width


def test_models_info_prints_shape_and_fingerprint(model):
    result, output = run_cli("models", "info")
    assert result.exit_code == 0, output
    assert "num_layers=30" in output and "num_kv_heads=3" in output
    assert f"fingerprint {model.fingerprint}" in output


def test_models_info_on_a_missing_model_exits_1_with_the_reason():
    result, output = run_cli("models", "info", "--model", "/nonexistent/model")
    assert result.exit_code == 1
    assert "error: model '/nonexistent/model' not found" in output
    assert "--model PATH" in output
