"""Fixtures of the store tests: a small synthetic shape for store mechanics, real chunk KV where the model
matters."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from cacheblend_rag.blend.segments import ChunkKV, prefill_chunk_kv
from cacheblend_rag.models.runtime import LayerwiseModel, ModelShape


def _load_support(name: str, path: Path):
    """Import a support module by path and register it, so that this directory's test modules can
    ``from <name> import ...`` although tests run with --import-mode=importlib."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


FINGERPRINT = _load_support("store_support", Path(__file__).with_name("store_support.py")).FINGERPRINT


@pytest.fixture
def shape() -> ModelShape:
    """A small shape: store mechanics do not depend on the numbers inside the KV."""
    return ModelShape(
        "llama",
        num_layers=4,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=100,
        max_context=512,
    )


@pytest.fixture
def make_kv(shape: ModelShape) -> Callable[..., ChunkKV]:
    def make(n: int = 16, seed: int = 0, fingerprint: str = FINGERPRINT, dtype=torch.float32) -> ChunkKV:
        generator = torch.Generator().manual_seed(seed)
        dims = (shape.num_kv_heads, n, shape.head_dim)
        keys = [torch.randn(dims, generator=generator).to(dtype) for _ in range(shape.num_layers)]
        values = [torch.randn(dims, generator=generator).to(dtype) for _ in range(shape.num_layers)]
        return ChunkKV(keys, values, fingerprint)

    return make


@pytest.fixture(scope="session")
def real_chunks(model: LayerwiseModel) -> list[tuple[list[int], ChunkKV]]:
    """Two short real chunks of the default model: (token ids, KV)."""
    texts = [
        "The Eiffel Tower was completed in 1889 for the World's Fair in Paris.",
        "Marie Curie won Nobel Prizes in both physics and chemistry.",
    ]
    out = []
    for text in texts:
        ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append((ids, prefill_chunk_kv(model, ids)))
    return out


# -- a real Redis server for the remote-tier tests (tests/redis_support.py) ------------------------------
# (on a free loopback port; the fixture skips, saying why, when no redis-server binary is found)
redis_server = _load_support("redis_support", Path(__file__).parents[1] / "redis_support.py").redis_server
