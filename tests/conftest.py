"""Fixtures shared by every test area. Model-heavy ones are session-scoped: load once, reuse everywhere."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from cacheblend_rag.models.loader import load_model
from cacheblend_rag.models.runtime import LayerwiseModel

DATA_DIR = Path(__file__).parent / "data"
# helpers shared by test areas (support/op_counting.py): importable by name under --import-mode=importlib;
# their own folder, since tests/ itself holds folders named like packages (tests/vllm would shadow vllm)
sys.path.insert(0, str(Path(__file__).parent / "support"))


def _share_the_cores_among_xdist_workers() -> None:
    """Under pytest-xdist (``make test`` runs one worker per core), each worker and the processes it starts
    get the cores divided among the workers, so two workers on two cores do not run four torch threads.
    Much of the suite is single-threaded Python (imports of child processes, servers, tokenizers, small
    operators): two one-thread workers finish it sooner than one two-thread process. A value set by hand
    is kept.

    xdist's workers also start with COLUMNS=80 and LINES=24 in their environment, which a serial run does
    not have: a Rich console made while COLUMNS is set keeps that width, and a test's own COLUMNS could no
    longer widen the CLI's module-level consoles. Workers drop both, as a serial run sees them.

    Called when this file is imported, before any conftest below it: those load before pytest_configure
    when a run names their folders, and may import the CLI."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.pop("COLUMNS", None)
        os.environ.pop("LINES", None)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        os.environ.setdefault("CACHEBLEND_THREADS", threads)
        os.environ.setdefault("OMP_NUM_THREADS", threads)


_share_the_cores_among_xdist_workers()


@pytest.fixture(autouse=True)
def _settings_environment_restored():
    """Put every ``CACHEBLEND_*`` variable back after each test (a test that sets one by hand and fails
    before undoing it must not leave a later test talking to a Redis server that is gone), and drop the
    cached settings."""
    from cacheblend_rag.settings import ENV_PREFIX, get_settings

    before = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    if after != before:
        for name in after.keys() - before.keys():
            del os.environ[name]
        os.environ.update(before)
    # always: a test's monkeypatch may have set and restored a variable already, leaving settings cached
    # from while it was set (a dead Redis URL then reached later tests' `store verify`)
    get_settings.cache_clear()


@pytest.fixture(scope="session")
def model() -> LayerwiseModel:
    """The default model (SmolLM2-135M-Instruct), fp32 on CPU, loaded with the test process's settings (its
    threads: CACHEBLEND_THREADS)."""
    from cacheblend_rag.settings import get_settings

    return load_model(config=get_settings())


@pytest.fixture(scope="session")
def musique_case() -> dict:
    """A real MuSiQue case: ``question``, ``answers``, 10 Wikipedia ``paragraphs`` (see data/README.md)."""
    return json.loads((DATA_DIR / "musique_case0.json").read_text())


EXAMPLES_DATA_DIR = Path(__file__).parent.parent / "examples" / "data"


@pytest.fixture(scope="session")
def model_tokenizer():
    """The default model's tokenizer and fingerprint, without its weights."""
    from cacheblend_rag.models.tokenizer import load_model_tokenizer

    return load_model_tokenizer()


@pytest.fixture(scope="session")
def embedder():
    """The default sentence embedder (all-MiniLM-L6-v2), shared by the process."""
    from cacheblend_rag.corpus.embedder import get_embedder

    return get_embedder()


@pytest.fixture(scope="session")
def sample_questions() -> list[dict]:
    """The demo questions over the sample corpus (examples/data/questions.json)."""
    return json.loads((EXAMPLES_DATA_DIR / "questions.json").read_text())


@pytest.fixture(scope="session")
def sample_store(tmp_path_factory, model_tokenizer, embedder) -> Path:
    """The sample corpus (examples/data/corpus) ingested without KV precompute. Treat as read-only:
    tests that change a store copy it first."""
    from cacheblend_rag.ingest.pipeline import ingest

    store = tmp_path_factory.mktemp("sample") / "store"
    ingest([EXAMPLES_DATA_DIR / "corpus"], store, precompute_kv=False)
    return store


@pytest.fixture(scope="session")
def shared_rag_store(tmp_path_factory, sample_store) -> Path:
    """One copy of the sample store for the whole session, for the integration tests that share one engine
    per corpus (``corpus_dir``): they only read its documents, and the chunk KV one of them computes stays
    for the next (a cache: the same bytes whoever computes them). A test that adds, deletes or recodes, or
    gives an engine its own KV folder, takes :func:`rag_store`."""
    import shutil

    store = tmp_path_factory.mktemp("rag") / "store"
    shutil.copytree(sample_store, store)
    return store


@pytest.fixture
def rag_store(tmp_path, sample_store) -> Path:
    """A writable copy of the sample store, the test's own: what it writes reaches no other test."""
    import shutil

    store = tmp_path / "rag-store"
    shutil.copytree(sample_store, store)
    return store
