"""``cacheblend-rag store ...`` and ``cacheblend-rag profile``."""

from __future__ import annotations

import json

import pytest
from store_support import FINGERPRINT, flip_byte, tensor_span
from typer.testing import CliRunner

from cacheblend_rag.cli import app
from cacheblend_rag.settings import get_settings
from cacheblend_rag.store.kvstore import KVStore

runner = CliRunner()


@pytest.fixture
def corpus_dir(tmp_path, shape, make_kv):
    (tmp_path / "manifest.json").write_text(json.dumps({"model": "test", "model_fingerprint": FINGERPRINT}))
    store = KVStore(tmp_path / "kv", FINGERPRINT, shape, "float16")
    keys = [store.chunk_key([i]) for i in range(3)]
    for i, key in enumerate(keys):
        store.put(key, make_kv(seed=i))
    store.close()
    return tmp_path, keys


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def test_stats(corpus_dir):
    root, _ = corpus_dir
    result = invoke("store", "stats", "--corpus", root, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["disk"]["entries"] == 3 and data["model_fingerprint"] == FINGERPRINT
    table = invoke("store", "stats", "--corpus", root)
    assert table.exit_code == 0 and "disk" in table.output


def test_stats_without_manifest_reads_the_index(corpus_dir):
    root, _ = corpus_dir
    (root / "manifest.json").unlink()
    result = invoke("store", "stats", "--corpus", root, "--json")
    assert result.exit_code == 0 and json.loads(result.output)["model_fingerprint"] == FINGERPRINT


def test_verify_fails_on_corruption_and_repairs(corpus_dir):
    root, keys = corpus_dir
    path = root / "kv" / "chunks" / keys[1][:2] / f"{keys[1]}.safetensors"
    start, _ = tensor_span(path, "layers.0.values")
    flip_byte(path, start)
    bad = invoke("store", "verify", "--corpus", root)
    assert bad.exit_code == 1 and "1 corrupt" in bad.output and "--repair" in bad.output
    fixed = invoke("store", "verify", "--corpus", root, "--repair")
    assert fixed.exit_code == 0 and not path.exists()
    clean = invoke("store", "verify", "--corpus", root, "--json")
    assert clean.exit_code == 0 and json.loads(clean.output)["clean"]


def test_gc_and_clear(corpus_dir):
    root, _ = corpus_dir
    result = invoke("store", "gc", "--corpus", root, "--json")
    assert result.exit_code == 0 and json.loads(result.output)["evicted"] == 0
    refused = runner.invoke(app, ["store", "clear", "--corpus", str(root)], input="n\n")
    assert refused.exit_code != 0 and len(list((root / "kv" / "chunks").rglob("*.safetensors"))) == 3
    cleared = invoke("store", "clear", "--corpus", root, "--yes")
    assert cleared.exit_code == 0 and "removed 3" in cleared.output
    assert not list((root / "kv" / "chunks").rglob("*.safetensors"))


def test_missing_store_is_a_clear_error(tmp_path):
    result = invoke("store", "stats", "--corpus", tmp_path / "nowhere")
    assert result.exit_code == 1 and "no KV store" in result.output


def test_profile_command_saves_a_profile(model, tmp_path, monkeypatch):
    # The model folder is read before CACHEBLEND_HOME moves: the new home has no models.
    model_dir = get_settings().models_dir / model.name
    monkeypatch.setenv("CACHEBLEND_HOME", str(tmp_path))
    monkeypatch.setenv("CACHEBLEND_MODEL", str(model_dir))
    get_settings.cache_clear()
    try:
        result = invoke("profile", "--lengths", "16,32", "--chunk-tokens", "16", "--repeats", "1")
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    saved = list((tmp_path / "profiles").glob("*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["model_fingerprint"] == model.fingerprint
    assert "r=" in result.output
    bad = invoke("profile", "--lengths", "a,b")
    assert bad.exit_code != 0
