"""An eval results file as typed records: what ``cacheblend-rag eval`` and ``tune`` write, and the report,
the headline and the tools read.

:class:`EvalResults` holds the run's :class:`RunConfig`, a :class:`CaseRecord` per case (with a
:class:`~cacheblend_rag.engine.fidelity.MethodRecord` per method) and the :class:`EvalSummary` (a
:class:`~cacheblend_rag.engine.fidelity.MethodRow` per method and the default's claims). Each is a
:class:`~cacheblend_rag.records.JsonRecord`: a key it does not know, or a required key missing,
fails the read naming it, and a file read and written again is the same bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine.fidelity import MethodRecord, MethodRow
from ..errors import EvalDataError
from ..records import JsonRecord
from .results import write_json_atomic
from .retrieval import CaseChunk

__all__ = [
    "RESULTS_FORMAT",
    "CaseRecord",
    "Check",
    "EvalResults",
    "EvalSummary",
    "MethodRecord",
    "MethodRow",
    "PromptRecord",
    "RetrievedRecord",
    "RunConfig",
    "load_results",
    "read_results",
    "save_results",
]

RESULTS_FORMAT = "cacheblend-rag-eval/1"


@dataclass(frozen=True, kw_only=True)
class RetrievedRecord(JsonRecord):
    """A chunk a case's prompt holds: the context it was cut from, its place in that context, its length
    and its retrieval score (None: summaries take chunks in document order)."""

    context: int
    chunk: int
    tokens: int
    score: float | None

    @classmethod
    def of(cls, chunk: CaseChunk) -> RetrievedRecord:
        return cls(context=chunk.context, chunk=chunk.chunk, tokens=len(chunk.token_ids), score=chunk.score)


@dataclass(frozen=True, kw_only=True)
class CaseRecord(JsonRecord):
    """One case of a results file: the question, what was retrieved and every method's record."""

    id: int
    question: str
    answers: list[str]
    chunks_total: int
    retrieved: list[RetrievedRecord]
    prompt_tokens: int
    cached_tokens: int
    precompute_s: float
    methods: dict[str, MethodRecord]


@dataclass(frozen=True, kw_only=True)
class PromptRecord(JsonRecord):
    """The prompt a run answered with (its question: ``{question}`` or the summary instruction)."""

    system: str
    user_template: str
    question: str


@dataclass(frozen=True, kw_only=True)
class RunConfig(JsonRecord):
    """What a run was: the data, its cut and retrieval, the model, the codecs, the prompt."""

    data: str
    dataset: str
    dataset_path: str
    dataset_sha256: str
    task: str
    limit: int | None
    seed: int
    top_k: int
    chunk_tokens: int
    max_new_tokens: int
    engine: str | None = None  # results recorded before it lack it: see engine_kind
    methods_revision: int | None = None  # results recorded before it lack it: see revision
    model: str
    model_fingerprint: str
    compute_dtype: str
    kv_dtype: str
    kv_dtypes: list[str] | None = None  # the oldest results lack it: their kv_dtype alone
    chunk_context: str
    skip: int
    # nats splitting decisive cases from near-ties; results recorded before it lack it
    decisive_margin: float | None = None
    kv_dir: str
    retrieval: str
    prompt: PromptRecord

    @property
    def engine_kind(self) -> str:
        """The engine that answered (results from before it was recorded were answered by ours)."""
        return self.engine if self.engine is not None else "torch"

    @property
    def revision(self) -> int:
        """What the method labels computed (blend/methods.py; results from before it was recorded: 1)."""
        return self.methods_revision if self.methods_revision is not None else 1

    @property
    def codecs(self) -> list[str]:
        """The chunk KV codecs compared, the run's own first."""
        return self.kv_dtypes or [self.kv_dtype]


@dataclass(frozen=True, kw_only=True)
class Check(JsonRecord):
    """A claim on the default method, checked on a run's numbers (``detail``: the numbers)."""

    claim: str
    passed: bool
    detail: Any


@dataclass(frozen=True, kw_only=True)
class EvalSummary(JsonRecord):
    """Per-method means over the cases and the default's claims checked on them."""

    cases: int
    # the margin first-token agreement was split at; summaries recorded before it lack it (split at the
    # default, if at all)
    decisive_margin: float | None = None
    methods: dict[str, MethodRow]
    checks: list[Check]


@dataclass(frozen=True, kw_only=True)
class EvalResults(JsonRecord):
    """A results file: the run, its commands, every case, the machine and the summary."""

    format: str
    config: RunConfig
    commands: list[str]
    cases: list[CaseRecord]
    machine: dict[str, Any]
    summary: EvalSummary | None = None  # None until the first case is summarised
    resumes: list[dict[str, Any]] | None = None  # the machine at each resume: a run never resumed lacks it

    def summarized(self) -> EvalSummary:
        """The summary, which every results file written holds (EvalDataError before the first case)."""
        if self.summary is None:
            raise EvalDataError(f"the {self.config.dataset} results hold no summary: no case has finished")
        return self.summary


def read_results(data: Any, where: str) -> EvalResults:
    """The results ``data`` (a results file's JSON) holds; ``where`` names it in errors."""
    if not isinstance(data, dict) or data.get("format") != RESULTS_FORMAT:
        raise EvalDataError(f"{where} is not a cacheblend-rag eval results file (format {RESULTS_FORMAT})")
    return EvalResults.from_dict(data, where)


def load_results(path: str | Path) -> EvalResults:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise EvalDataError(f"cannot read results file {path}: {exc}") from exc
    return read_results(data, str(path))


def save_results(results: EvalResults, path: str | Path) -> None:
    """Write atomically: a crash mid-write leaves the previous file."""
    write_json_atomic(results.to_dict(), path)
