"""``CacheBlendRAG.check``: evidence on the user's own model and corpus before they turn KV reuse on.

Each question is retrieved for exactly as :meth:`~cacheblend_rag.rag.CacheBlendRAG.query` retrieves, then
answered by full prefill and by the method at each ratio asked for, one after the other (so TTFTs are
measured side by side), through :func:`~cacheblend_rag.engine.fidelity.compare_methods`, the runner
``cacheblend-rag eval`` scores its cases with: the same first-token agreement, first-token KL and
agreement F1, averaged by the same :func:`~cacheblend_rag.engine.fidelity.method_table`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from .blend.spec import MethodSpec
from .config import Config
from .corpus.corpus import Corpus, RetrievedChunk
from .engine import ChunkRef, EngineProtocol, SamplingParams
from .engine.fidelity import REFERENCE, MethodRun, compare_methods, method_table, store_in_ram

log = logging.getLogger(__name__)


class CheckedRAG(Protocol):
    """What :func:`run_check` reads of the :class:`~cacheblend_rag.rag.CacheBlendRAG` it checks (typed by
    what it uses: ``rag`` calls this module, so this module does not import it back)."""

    corpus: Corpus
    engine: EngineProtocol
    config: Config

    def retrieve(self, question: str, top_k: int | None = None) -> list[RetrievedChunk]: ...


_SENTENCE_END = re.compile(r"(?<=[.!?])\s|\n")
_QUESTION_WORDS = 12  # words of a chunk's first sentence a sampled question quotes


@dataclass
class CheckRow:
    """One method at one ratio, averaged over the questions (the reference's row scores itself)."""

    label: str
    ratio: float | None  # the recompute ratio asked for; None: the method has none, or the controller's
    first_token_agreement: float
    kl_first_token: float
    agreement_f1: float
    ttft_median_s: float
    speedup_median: float  # median over questions of full prefill's TTFT / this method's, side by side
    chunk_recompute_ratio: float  # share of the retrieved chunks' tokens recomputed
    compute_fraction: float  # the fusion's compute relative to a full prefill


@dataclass
class CheckReport:
    """What :meth:`CacheBlendRAG.check` measured: a row per method (full prefill first), the questions
    with their chunks and per-method records, and the lowest ratio meeting the target when one was
    given (else None, with the reason in ``target_note``)."""

    rows: list[CheckRow]
    questions: list[str]
    sampled: bool  # the questions were derived from the corpus's chunks
    target_agreement: float | None
    lowest_ratio_meeting_target: float | None
    target_note: str
    max_new_tokens: int
    cases: list[dict[str, Any]] = field(default_factory=list)

    def row(self, label: str) -> CheckRow:
        return next(r for r in self.rows if r.label == label)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_options(
    ratios: Sequence[float | None], target_agreement: float | None, max_new_tokens: int, sample: int
) -> None:
    """Refuse bad options with a clear ValueError (the CLI calls this before loading anything)."""
    if not ratios:
        raise ValueError("give at least one ratio")
    for ratio in ratios:
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            raise ValueError(f"a recompute ratio must be between 0 and 1, got {ratio}")
    if target_agreement is not None and not 0.0 < target_agreement <= 1.0:
        raise ValueError(f"the target agreement must be in (0, 1], got {target_agreement}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if sample < 1:
        raise ValueError(f"sample must be >= 1, got {sample}")


def clean_questions(questions: Sequence[str]) -> list[str]:
    """The questions stripped, blank ones refused; at least one."""
    if isinstance(questions, str):
        questions = [questions]
    out = [q.strip() for q in questions if isinstance(q, str)]
    if len(out) != len(questions) or not all(out):
        raise ValueError("every question must be a non-empty string")
    if not out:
        raise ValueError("no questions: give at least one, or none to sample them from the corpus")
    return out


def sample_questions(corpus: Corpus, n: int) -> list[str]:
    """``n`` questions derived from the corpus's chunks, deterministically: the chunks at ``n`` evenly
    spaced places of the corpus's chunk order (of ``count`` chunks, the i-th at ``i * count // n``; all
    of them when ``n >= count``), each asked as
    ``What does the text say about <its first sentence's first 12 words, end punctuation dropped>?``;
    questions that come out the same are asked once (so fewer than ``n`` may come back)."""
    ids = list(corpus.db.iter_chunk_ids())
    if not ids:
        raise ValueError(f"corpus {corpus.corpus_dir} holds no chunks to derive questions from")
    count = min(n, len(ids))
    picked = [ids[i * len(ids) // count] for i in range(count)]  # distinct: count <= len(ids)
    questions: dict[str, None] = {}
    for chunk in corpus.get_chunks(picked):
        sentence = _SENTENCE_END.split(chunk.text.strip(), maxsplit=1)[0]
        words = " ".join(sentence.split()[:_QUESTION_WORDS]).rstrip(".!?;:,")
        if words:
            questions[f"What does the text say about {words}?"] = None
    return list(questions)


def method_runs(engine: EngineProtocol, method: str, ratios: Sequence[float | None]) -> list[MethodRun]:
    """Full prefill, then ``method`` once per ratio; once as given when it has no ratio or names its
    own."""
    base = MethodSpec.parse(method)
    if base.label == REFERENCE:
        raise ValueError(f"{REFERENCE} is the reference check compares against; name another method")
    specs = [base] if base.method_class.ratio_option is None or base.ratio is not None else None
    specs = specs or list({s.label: s for s in (base.with_ratio(r) for r in ratios)}.values())
    return [MethodRun(REFERENCE, MethodSpec.parse(REFERENCE), engine)] + [
        MethodRun(spec.label, spec, engine) for spec in specs
    ]


def run_check(
    rag: CheckedRAG,
    questions: Sequence[str] | None = None,
    ratios: Sequence[float | None] | None = None,
    method: str | None = None,
    target_agreement: float | None = None,
    max_new_tokens: int = 32,
    sample: int = 20,
    top_k: int | None = None,
) -> CheckReport:
    """See :meth:`CacheBlendRAG.check` (the defaults are ``rag.config``'s)."""
    ratios = list(ratios) if ratios is not None else [rag.config.ratio]
    check_options(ratios, target_agreement, max_new_tokens, sample)
    sampled = questions is None
    asked = sample_questions(rag.corpus, sample) if questions is None else clean_questions(questions)
    engine = rag.engine  # scored from what it returns: each answer's diagnostics
    runs = method_runs(engine, method or rag.config.method, ratios)
    sampling = SamplingParams(max_new_tokens=max_new_tokens)
    cases = []
    for number, question in enumerate(asked):
        chunks = rag.retrieve(question, top_k)
        refs = [ChunkRef(c.token_ids, c.chunk_id) for c in chunks]
        store_in_ram(engine, question, refs, [run.spec for run in runs])
        compared, prompt_tokens = compare_methods(runs, question, refs, sampling, nll_reference=False)
        records = {label: record.to_dict() for label, record in compared.items()}
        for record in records.values():
            record.pop("answer_tokens")
        cases.append(
            {
                "id": number,
                "question": question,
                "chunk_ids": [c.chunk_id for c in chunks],
                "prompt_tokens": prompt_tokens,
                "methods": records,
            }
        )
        log.info("check: question %d of %d (%d prompt tokens)", number + 1, len(asked), prompt_tokens)
    table = method_table(cases, [run.label for run in runs])
    rows = [_row(run.label, run.spec.ratio, table[run.label]) for run in runs]
    lowest, note = _lowest_meeting(rows[1:], target_agreement)
    return CheckReport(rows, asked, sampled, target_agreement, lowest, note, max_new_tokens, cases)


def _row(label: str, ratio: float | None, entry: dict[str, Any]) -> CheckRow:
    return CheckRow(
        label=label,
        ratio=ratio,
        first_token_agreement=entry["first_token_agreement"],
        kl_first_token=entry["kl_first_token"],
        agreement_f1=entry["agreement_f1"],
        ttft_median_s=entry["ttft_median_s"],
        speedup_median=entry["speedup_median"],
        chunk_recompute_ratio=entry["chunk_recompute_ratio"],
        compute_fraction=entry["compute_fraction"],
    )


def _lowest_meeting(rows: Sequence[CheckRow], target: float | None) -> tuple[float | None, str]:
    if target is None:
        return None, "no target agreement given"
    with_ratio = sorted((r for r in rows if r.ratio is not None), key=lambda r: r.ratio)
    if not with_ratio:
        return None, "the method was run without a recompute ratio"
    for row in with_ratio:
        if row.first_token_agreement >= target:
            return (
                row.ratio,
                f"{row.label}: first-token agreement {row.first_token_agreement:.3f} >= {target}",
            )
    best = max(with_ratio, key=lambda r: r.first_token_agreement)
    return None, (
        f"no ratio tried reaches first-token agreement {target} (best: {best.label} at "
        f"{best.first_token_agreement:.3f}); try higher ratios"
    )
