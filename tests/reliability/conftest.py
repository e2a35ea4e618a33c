"""Fixtures of the reliability suite: one small real store shared by the session, fault-free reference
answers, and the fault log whose table is printed at the end of the run.

The store is ingested once (real model, real embedder, real FAISS, KV precomputed) from excerpts of the
sample corpus; a test that damages a store works on a copy. Answers are greedy and short, so a test can
demand that an answer under a fault equals the fault-free one exactly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cacheblend_rag.engine import Engine
from cacheblend_rag.ingest.pipeline import ingest

# Register the support module so that test modules can import it (tests run with --import-mode=importlib).
_spec = importlib.util.spec_from_file_location(
    "reliability_support", Path(__file__).with_name("reliability_support.py")
)
support = importlib.util.module_from_spec(_spec)
sys.modules["reliability_support"] = support
_spec.loader.exec_module(support)

_ROWS = pytest.StashKey[list]()
_PASSED = pytest.StashKey[bool]()


# a real Redis server per test, for the remote KV tier's faults (tests/redis_support.py)
_redis_spec = importlib.util.spec_from_file_location(
    "redis_support", Path(__file__).parents[1] / "redis_support.py"
)
redis_support = importlib.util.module_from_spec(_redis_spec)
sys.modules["redis_support"] = redis_support
_redis_spec.loader.exec_module(redis_support)
redis_server = redis_support.redis_server


@pytest.fixture(scope="session")
def rel_questions() -> list[str]:
    """Three demo questions, one per document of the reliability store."""
    questions = json.loads((support.EXAMPLES_DIR / "questions.json").read_text())
    by_case = {q["case"]: q["question"] for q in questions}
    return [by_case[5], by_case[13], by_case[10]]


@pytest.fixture(scope="session")
def rel_docs(tmp_path_factory) -> Path:
    """Three short documents (.md, .txt, .jsonl) cut from the sample corpus (examples/data, CC BY 4.0)."""
    corpus = support.EXAMPLES_DIR / "corpus"
    docs = tmp_path_factory.mktemp("rel-docs")
    lessing = (corpus / "musique_case005.md").read_text()
    (docs / "lessing.md").write_text(
        "# Lessing\n\n" + support.excerpt(lessing, "miss sara sampson", "premiered on 8 march 1772") + "\n"
    )
    packer = (corpus / "musique_case013.txt").read_text()
    (docs / "packer.txt").write_text(
        support.excerpt(packer, "in an afterword", "a washington lobbyist") + "\n"
    )
    record = json.loads((corpus / "musique_case010.jsonl").read_text().splitlines()[0])
    record["text"] = support.excerpt(record["text"], "bang bang rock & roll is", "eddie argos")
    (docs / "bands.jsonl").write_text(json.dumps(record) + "\n")
    return docs


@pytest.fixture(scope="session")
def rel_store(tmp_path_factory, rel_docs, model, embedder) -> Path:
    """The reliability store, every chunk's KV precomputed. Built under umask 000, the most permissive a
    user can have, so that the permission test proves the store sets its own modes. Never modified by
    tests: they work on ``store_copy()``."""
    store = tmp_path_factory.mktemp("rel") / "store"
    old = os.umask(0)
    try:
        engine = Engine(model=model, store=store / "kv")
        try:
            ingest([rel_docs], store, chunk_tokens=support.CHUNK_TOKENS, engine=engine)
        finally:
            engine.store.close()
    finally:
        os.umask(old)
    return store


@pytest.fixture(scope="session")
def reference(rel_store, model):
    """Fault-free answers (:class:`reliability_support.Reference`) over the pristine shared store."""
    return support.Reference(rel_store, model)


@pytest.fixture
def store_copy(rel_store, tmp_path):
    """``store_copy(name="store") -> Path``: a private copy of the reliability store under tmp_path."""

    def copy(name: str = "store") -> Path:
        target = tmp_path / name
        # shared-memory and lock files belong to this process's connections and locks: never copy them
        shutil.copytree(rel_store, target, ignore=shutil.ignore_patterns("*-shm", "*.lock"))
        return target

    return copy


@pytest.fixture(scope="session")
def rag_on(model):
    """``with rag_on(corpus_dir) as rag: ...`` on the session's model."""
    return lambda corpus_dir: support.open_rag(corpus_dir, model)


# -- the fault log and its summary ---------------------------------------------------------------------


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.stash[_PASSED] = report.passed


@pytest.fixture
def faults(request) -> Iterator:
    """This test's :class:`reliability_support.FaultLog`; its rows count as survived if the test passes."""
    log = support.FaultLog(request.config.stash.setdefault(_ROWS, []))
    yield log
    passed = request.node.stash.get(_PASSED, False)
    for row in log.rows:
        row.survived = passed


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rows = config.stash.get(_ROWS, None)
    if rows:
        terminalreporter.write_sep("=", "reliability: faults injected and how the product coped")
        for line in support.summary_lines(rows):
            terminalreporter.write_line(line)
