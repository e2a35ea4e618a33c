"""Evaluation data sets: ``[{question, answers, ctxs: [{title, text}]}]`` files and their seeded subsets.

Three subsets ship with the package (see ``data/README.md``): ``musique`` (60 MuSiQue cases, short-answer
QA; the development split), ``musique-heldout`` (the other 90 cases of the same file, held out) and
``multinews`` (30 Multi-News cases, summarisation; none used to choose a default) and ``multinews-dev``
(the next 30 of the same file, where rules for short passages are chosen). Any file in the same
layout (``.json`` or ``.json.gz``) is accepted by path.

How contexts are cut is the run's choice, not the set's (``--chunk-tokens``, ``--top-k``; one owner each):
``--data multinews --chunk-tokens 128`` is the short-passage Multi-News set (each article cut into chunks
of at most 128 tokens, the first ``--top-k`` in document order; ``make eval-short``). A MuSiQue case's
contexts are not MuSiQue's paragraphs but ten overlapping windows of about 600 tokens over them, with no
record of where a paragraph ends (``data/README.md``), so these files hold no set of whole paragraphs.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import EvalDataError

DATA_DIR = Path(__file__).parent / "data"
BUNDLED = {
    "musique": DATA_DIR / "musique_s.seed0-60.json.gz",
    # the 90 other MuSiQue cases: never used to choose a method's defaults (see docs/fusor.md)
    "musique-heldout": DATA_DIR / "musique_s.heldout-seed0-90.json.gz",
    "multinews": DATA_DIR / "multi_news.seed0-30.json.gz",
    # the next 30 of the seeded order: where short-passage rules are chosen, so the 30 above stay held out
    "multinews-dev": DATA_DIR / "multi_news.dev-seed0-30-60.json.gz",
}
TASKS = ("qa", "summary")


@dataclass(frozen=True)
class Context:
    title: str
    text: str

    @property
    def document(self) -> str:
        """The text chunked for this context: the title (when there is one) on its own line, then the text."""
        return f"{self.title}\n{self.text}" if self.title else self.text


@dataclass(frozen=True)
class EvalCase:
    """One question (empty for summarisation), its gold answers and its contexts."""

    case_id: int
    question: str
    answers: tuple[str, ...]
    contexts: tuple[Context, ...]


@dataclass(frozen=True)
class Dataset:
    name: str
    path: Path
    sha256: str
    cases: tuple[EvalCase, ...]

    @property
    def task(self) -> str:
        """``summary`` when no case has a question (Multi-News), else ``qa``."""
        return "summary" if all(not c.question.strip() for c in self.cases) else "qa"


def resolve_data_path(spec: str | Path) -> Path:
    """A bundled data set's file (``musique``, ``multinews``) or a path to a data file."""
    if str(spec) in BUNDLED:
        return BUNDLED[str(spec)]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise EvalDataError(
            f"no data set {str(spec)!r}: give a file path or one of {', '.join(sorted(BUNDLED))}"
        )
    return path


def load_dataset(spec: str | Path) -> Dataset:
    """Read a data set; raises :class:`EvalDataError` naming the first malformed case."""
    path = resolve_data_path(spec)
    raw = path.read_bytes()
    try:
        items = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
    except (OSError, ValueError) as exc:
        raise EvalDataError(f"{path} is not a (gzipped) JSON file: {exc}") from exc
    if not isinstance(items, list) or not items:
        raise EvalDataError(f"{path}: expected a non-empty JSON list of cases")
    cases, seen = [], set()
    for index, item in enumerate(items):
        case = _parse_case(item, index, path)
        if case.case_id in seen:
            raise EvalDataError(f"{path}: case id {case.case_id} appears twice")
        seen.add(case.case_id)
        cases.append(case)
    name = str(spec) if str(spec) in BUNDLED else path.name.split(".")[0]
    return Dataset(name, path, hashlib.sha256(raw).hexdigest(), tuple(cases))


def _parse_case(item: object, index: int, path: Path) -> EvalCase:
    where = f"{path}: case {index}"
    if not isinstance(item, dict):
        raise EvalDataError(f"{where} is not an object")
    question, answers, ctxs = item.get("question", ""), item.get("answers"), item.get("ctxs")
    if not isinstance(question, str):
        raise EvalDataError(f"{where}: 'question' must be a string")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise EvalDataError(f"{where}: 'answers' must be a non-empty list of strings")
    if not isinstance(ctxs, list) or not ctxs:
        raise EvalDataError(f"{where}: 'ctxs' must be a non-empty list of {{title, text}} objects")
    contexts = []
    for j, ctx in enumerate(ctxs):
        if not isinstance(ctx, dict) or not isinstance(ctx.get("text"), str):
            raise EvalDataError(f"{where}: ctxs[{j}] needs a string 'text'")
        title = ctx.get("title") or ""
        if not isinstance(title, str):
            raise EvalDataError(f"{where}: ctxs[{j}].title must be a string")
        contexts.append(Context(title.strip(), ctx["text"]))
    if not any(c.document.strip() for c in contexts):
        raise EvalDataError(f"{where}: every context is empty")
    case_id = item.get("id", index)
    if not isinstance(case_id, int) or isinstance(case_id, bool):
        raise EvalDataError(f"{where}: 'id' must be an integer")
    return EvalCase(case_id, question.strip(), tuple(answers), tuple(contexts))


def selection_key(seed: int, case_id: int) -> str:
    return hashlib.sha256(f"{seed}:{case_id}".encode()).hexdigest()


def select_cases(cases: tuple[EvalCase, ...], limit: int | None, seed: int, skip: int = 0) -> list[EvalCase]:
    """The ``limit`` cases whose ``sha256(f"{seed}:{id}")`` sorts first after the first ``skip`` of that
    order, in id order (all the rest without a limit).

    The order depends only on the seed and each id, so a subset file gives the same selection as the full
    file whenever it holds the selected ids, and ``skip=60`` on the full MuSiQue file gives exactly the
    cases the shipped 60-case subset does not hold (a held-out set)."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if skip < 0:
        raise ValueError(f"--skip must be >= 0, got {skip}")
    chosen = list(cases)
    if skip or (limit is not None and limit < len(cases)):
        ordered = sorted(cases, key=lambda c: selection_key(seed, c.case_id))[skip:]
        chosen = ordered[:limit] if limit is not None else ordered
    return sorted(chosen, key=lambda c: c.case_id)
