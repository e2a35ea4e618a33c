"""Fixtures of the server tests: real ``cacheblend-rag serve`` processes on loopback ports over copies of
the sample corpus, and (for the two-node tests) a real Redis server."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest


def _load(name: str, path: Path):
    """Import a support module by path and register it (tests run with --import-mode=importlib)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


_load("serve_support", Path(__file__).with_name("serve_support.py"))
redis_server = _load("redis_support", Path(__file__).parents[1] / "redis_support.py").redis_server


@pytest.fixture(scope="module")
def served_corpus(tmp_path_factory, sample_store) -> Path:
    """A private copy of the sample corpus (no KV yet) for this module's server: it computes chunk KV on
    first use and may add documents, so no other module shares it."""
    corpus = tmp_path_factory.mktemp("served") / "corpus"
    shutil.copytree(sample_store, corpus, ignore=shutil.ignore_patterns("*-shm", "*.lock"))
    return corpus
