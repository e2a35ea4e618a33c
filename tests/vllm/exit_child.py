"""Run by test_vllm_exit.py as a pytest session of its own: a vLLM engine left open at the end."""

from __future__ import annotations

import pytest


def test_an_engine_left_open(tmp_path):
    pytest.importorskip("vllm")
    from cacheblend_rag.engine.vllm import VLLMEngine

    engine = VLLMEngine(store=tmp_path / "kv", max_model_len=1024, kv_cache_bytes=128 << 20)
    assert engine.context_window == 1024  # and never closed: the session and the exit hook see to it
