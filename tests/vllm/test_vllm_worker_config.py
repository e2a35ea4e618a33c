"""The vLLM worker takes its values from the connector's extra config, not from settings or the environment.

Needs no vLLM: the blender is built over the PyTorch model (its layout is not vLLM's, so the worker loads
its own copy, as it would for such a model), and runs in every environment.
"""

from __future__ import annotations

from cacheblend_rag.engine.vllm.worker import COPY, create_blender
from cacheblend_rag.models.provision import resolve_model_path
from cacheblend_rag.settings import get_settings


def test_the_worker_store_takes_the_drivers_values_not_the_environment(model, tmp_path, monkeypatch):
    # what the worker process would inherit: a remote tier nobody serves and a budget the driver overrides
    monkeypatch.setenv("CACHEBLEND_KV_REMOTE", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("CACHEBLEND_RAM_BUDGET_BYTES", "1")
    monkeypatch.setenv("CACHEBLEND_KV_DTYPE", "float32")
    get_settings.cache_clear()
    extra = {
        "model": str(resolve_model_path(None)),
        "home": str(tmp_path / "home"),
        "store": str(tmp_path / "kv"),
        "kv_dtype": "int8",
        "ram_budget_bytes": 12_345,
        "disk_budget_bytes": 67_890,
        "kv_remote": "",
        "chunk_context": [1, 2, 3],
        "share_weights": False,
    }
    blender = create_blender(extra, model.hf_model, model.dtype)
    store = blender.engine.store
    try:
        assert blender.weights == COPY and blender.engine.model.fingerprint == model.fingerprint
        assert (store.root, store.kv_dtype_name) == (tmp_path / "kv", "int8")
        assert (store.ram.budget, store.disk_budget_bytes, store.remote) == (12_345, 67_890, None)
        assert blender.engine.chunk_context.token_ids == (1, 2, 3)
        assert any((tmp_path / "home" / "checksums").iterdir())  # the driver's cache directory
    finally:
        store.close()
        get_settings.cache_clear()
