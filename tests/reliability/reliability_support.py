"""Helpers of the reliability suite, loaded by path from conftest (tests run with --import-mode=importlib)
and importable as ``reliability_support`` from its test modules."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

from cacheblend_rag.cli import app
from cacheblend_rag.engine import Engine, SamplingParams
from cacheblend_rag.rag import CacheBlendRAG
from cacheblend_rag.store.kvstore import KVStore

EXAMPLES_DIR = Path(__file__).parents[2] / "examples" / "data"
CHUNK_TOKENS = 128
TOP_K = 2
SAMPLING = SamplingParams(max_tokens=8)
CHILD_SCRIPT = Path(__file__).with_name("children.py")
# Child processes share the cores with this one: one torch thread each keeps them from thrashing. Their
# KV must still give this process's answers, as KV from any ingest must for any query process.
CHILD_ENV = {**os.environ, "CACHEBLEND_THREADS": "1"}
CHILD_TIMEOUT_S = 600.0


def excerpt(text: str, first: str, last: str) -> str:
    """``text`` from the sentence holding ``first`` through the end of the sentence holding ``last``."""
    start = text.rfind(". ", 0, text.index(first)) + 2
    end = text.index(". ", text.index(last)) + 1
    return text[start:end]


@contextmanager
def open_rag(corpus_dir: Path, model) -> Iterator[CacheBlendRAG]:
    """A CacheBlendRAG over ``corpus_dir`` on an already loaded model; closes its store and corpus after."""
    engine = Engine(model=model, store=Path(corpus_dir) / "kv")
    try:
        rag = CacheBlendRAG(corpus_dir, engine=engine)
        try:
            yield rag
        finally:
            rag.corpus.close()
    finally:
        engine.store.close()


def answer(rag: CacheBlendRAG, question: str, method: str = "cacheblend") -> str:
    """The greedy answer the suite compares (top-k and generation length fixed)."""
    return rag.query(question, top_k=TOP_K, method=method, sampling=SAMPLING).answer


class Reference:
    """Fault-free answers over the pristine shared store, computed once per (question, method)."""

    def __init__(self, corpus_dir: Path, model) -> None:
        self.corpus_dir = corpus_dir
        self.model = model
        self._answers: dict[tuple[str, str], str] = {}
        self._chunks: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def answer(self, question: str, method: str = "cacheblend") -> str:
        with self._lock:
            if (question, method) not in self._answers:
                with open_rag(self.corpus_dir, self.model) as rag:
                    result = rag.query(question, top_k=TOP_K, method=method, sampling=SAMPLING)
                self._answers[question, method] = result.answer
                self._chunks[question] = result.chunk_ids
            return self._answers[question, method]

    def answers(self, cases: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
        return {case: self.answer(*case) for case in cases}

    def chunk_ids(self, question: str) -> list[str]:
        """The chunks retrieved for ``question`` on the pristine store."""
        self.answer(question)
        return self._chunks[question]

    def kv_keys(self, question: str) -> list[str]:
        """KV keys of the chunks retrieved for ``question``, in retrieval order."""
        with open_rag(self.corpus_dir, self.model) as rag:
            return [c.kv_key for c in rag.corpus.get_chunks(self.chunk_ids(question))]


def kv_path(corpus_dir: Path, key: str) -> Path:
    """Where the KV store of ``corpus_dir`` keeps ``key``'s file."""
    with KVStore.open_existing(Path(corpus_dir) / "kv") as kv:
        return kv.path_for(key)


def kv_files(corpus_dir: Path) -> list[Path]:
    return sorted((Path(corpus_dir) / "kv" / "chunks").rglob("*.safetensors"))


def temp_files(corpus_dir: Path) -> list[Path]:
    return sorted((Path(corpus_dir) / "kv" / "chunks").rglob(".*.tmp"))


_runner = CliRunner()


def invoke_cli(*args: object):
    """Run ``cacheblend-rag ARGS...`` in this process (typer's runner); returns its result."""
    return _runner.invoke(app, [str(a) for a in args])


def store_verify(corpus_dir: Path, repair: bool = False) -> tuple[int, dict]:
    """``cacheblend-rag store verify --json [--repair]``: (exit code, report)."""
    repairing = ["--repair"] if repair else []
    result = invoke_cli("store", "verify", "--corpus", corpus_dir, "--json", *repairing)
    try:
        return result.exit_code, json.loads(result.output)
    except ValueError:
        return result.exit_code, {"output": result.output}


# -- child processes -----------------------------------------------------------------------------------


def start_child(*args: object) -> subprocess.Popen:
    """``python children.py ARGS...`` (see children.py); stdout and stderr are pipes."""
    argv = [sys.executable, str(CHILD_SCRIPT), *map(str, args)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=CHILD_ENV)


def wait_for(path: Path, child: subprocess.Popen | None = None, timeout: float = CHILD_TIMEOUT_S) -> None:
    """Wait until ``path`` exists; fail early, with the child's stderr, if ``child`` exits first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if child is not None and child.poll() is not None:
            raise AssertionError(f"child exited with {child.returncode}: {child.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(0.02)


def kill_when_stalled(child: subprocess.Popen, sync: Path) -> None:
    """SIGKILL ``child`` once it reports (SYNC/stalled) that it stopped at its injected point."""
    try:
        wait_for(sync / "stalled", child)
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL


# -- the fault log -------------------------------------------------------------------------------------


@dataclass
class FaultRow:
    area: str
    fault: str
    handling: str
    answers: int
    changed: int
    survived: bool = False


class FaultLog:
    """What one test injected and how the product coped; the rows print as a table after the run."""

    def __init__(self, rows: list[FaultRow]) -> None:
        self._all = rows
        self.rows: list[FaultRow] = []

    def record(
        self,
        area: str,
        fault: str,
        handling: str,
        got: dict[tuple[str, str], str] | None = None,
        want: dict[tuple[str, str], str] | None = None,
    ) -> list[tuple[str, str]]:
        """Log a fault and compare the answers given under it with the fault-free ones; returns the
        (question, method) pairs whose answer changed. A fault logged again by the same test (a property
        test logs once per example) adds to its row."""
        got, want = got or {}, want or {}
        changed = [case for case in got if got[case] != want.get(case)]
        row = next((r for r in self.rows if (r.area, r.fault) == (area, fault)), None)
        if row is None:
            row = FaultRow(area, fault, handling, 0, 0)
            self.rows.append(row)
            self._all.append(row)
        row.answers += len(got)
        row.changed += len(changed)
        return changed


def summary_lines(rows: list[FaultRow]) -> list[str]:
    """The table printed at the end of the run, and its totals line."""
    area_w, fault_w, handling_w = 12, 46, 62
    lines = [f"{'area':<{area_w}} {'fault':<{fault_w}} {'handling':<{handling_w}} answers changed ok"]
    for r in rows:
        handling = r.handling if len(r.handling) <= handling_w else r.handling[: handling_w - 1] + "…"
        lines.append(
            f"{r.area:<{area_w}} {r.fault[:fault_w]:<{fault_w}} {handling:<{handling_w}} "
            f"{r.answers:>7} {r.changed:>7} {'yes' if r.survived else 'NO'}"
        )
    areas = sorted({r.area for r in rows})
    kinds = len({(r.area, r.fault) for r in rows})
    survived = sum(r.survived for r in rows)
    answers, changed = sum(r.answers for r in rows), sum(r.changed for r in rows)
    lines.append(
        f"faults injected: {len(rows)} of {kinds} kinds in {len(areas)} areas ({', '.join(areas)}); "
        f"survived: {survived}/{len(rows)}; answers compared with the fault-free run: {answers}, "
        f"changed: {changed}"
    )
    return lines
