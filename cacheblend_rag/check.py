"""``CacheBlendRAG.check``: evidence on the user's own model and corpus before they turn KV reuse on.

Each question is retrieved for exactly as :meth:`~cacheblend_rag.rag.CacheBlendRAG.query` retrieves, then
answered by full prefill and by the method at each ratio asked for, one after the other (so TTFTs are
measured side by side), through :func:`~cacheblend_rag.engine.fidelity.compare_methods`, the runner
``cacheblend-rag eval`` scores its cases with: the same first-token agreement, first-token KL and
agreement F1, averaged by the same :func:`~cacheblend_rag.engine.fidelity.method_table`.

A verdict on a target agreement is given only when the evidence supports it: each method's first-token
agreement comes with its count (k of n questions) and a 95 % Wilson score interval, on all questions and
on the decisive ones alone (full prefill's first token leads its runner-up by at least
:data:`~cacheblend_rag.config.DECISIVE_MARGIN` nats by default; the rest are near-ties, counted apart). The
verdict reads the decisive agreement: on a near-tie full prefill itself could have gone either way, so a
method picking the runner-up there says nothing of its fidelity.

The first token alone can hide a changed answer (the same first word, then another fact or a loop): each
row also gives the share of answers that are full prefill's tokens (k of n, Wilson interval) and the mean
agreement F1 with full prefill's answer, with an interval. A ratio meets the target only when both whole
intervals clear it (decisive first tokens, answer F1); too few questions get how many more are needed.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TypedDict

from .blend.spec import DEFAULT_NAME, MethodSpec, named_default
from .config import DECISIVE_MARGIN, DEFAULT_CHECK_MAX_TOKENS, Config
from .corpus.corpus import Corpus, RetrievedChunk
from .engine import ChunkRef, EngineProtocol, SamplingParams
from .engine.fidelity import (
    REFERENCE,
    MethodRecord,
    MethodRow,
    MethodRun,
    compare_methods,
    method_table,
    store_in_ram,
)
from .engine.metrics import check_decisive_margin

log = logging.getLogger(__name__)


class CheckedRAG(Protocol):
    """What :func:`run_check` reads of the :class:`~cacheblend_rag.rag.CacheBlendRAG` it checks (``rag``
    calls this module: it is not imported back)."""

    corpus: Corpus
    engine: EngineProtocol
    config: Config

    def retrieve(self, question: str, top_k: int | None = None) -> list[RetrievedChunk]: ...


_SENTENCE_END = re.compile(r"(?<=[.!?])\s|\n")
_QUESTION_WORDS = 12  # words of a chunk's first sentence a sampled question quotes
CONFIDENCE_Z = 1.959964  # two-sided 95 % normal quantile, for the Wilson score interval
_MAX_QUESTIONS_NEEDED = 100_000  # beyond this, "more questions" is no longer useful advice


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
    questions: int = 0  # n: the questions this row was measured on
    agreeing: int = 0  # k: the questions whose first token equals full prefill's
    agreement_low: float = 0.0  # 95 % Wilson interval of the first-token agreement
    agreement_high: float = 1.0
    # the same on decisive questions alone (full prefill's first token leads by >= the decisive margin),
    # which the verdict reads; the rest are near-ties, where full prefill itself could have gone either way
    decisive_questions: int = 0
    decisive_agreeing: int = 0
    decisive_low: float = 0.0
    decisive_high: float = 1.0
    near_tie_questions: int = 0
    near_tie_agreeing: int = 0
    # the whole answer against full prefill's: how many answers are its very tokens (exact match, with its
    # Wilson interval), and the interval of the mean agreement F1, which the verdict reads beside the
    # decisive first tokens
    answers_equal: int = 0
    answer_match: float = 0.0
    answer_match_low: float = 0.0
    answer_match_high: float = 1.0
    agreement_f1_low: float = 0.0
    agreement_f1_high: float = 1.0
    # what the method chose per question (``BudgetChoice.text``, brief) with how many questions it chose
    # it for (empty when it chooses nothing per request)
    budgets: dict[str, int] = field(default_factory=dict)


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
    max_tokens: int
    cases: list[dict[str, Any]] = field(default_factory=list)
    # about how many more questions would settle the cheapest ratio whose decisive interval straddles the
    # target (None: no such ratio, it had no decisive question, or its agreement sits on the target itself)
    more_questions_needed: int | None = None
    decisive_margin: float = DECISIVE_MARGIN  # nats: at or above, a question is decisive

    def row(self, label: str) -> CheckRow:
        """The row of the method labelled ``label``."""
        for row in self.rows:
            if row.label == label:
                return row
        raise KeyError(f"no row {label!r}: the rows are {', '.join(r.label for r in self.rows) or 'none'}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_options(
    ratios: Sequence[float | None],
    target_agreement: float | None,
    max_tokens: int,
    sample: int,
    decisive_margin: float = DECISIVE_MARGIN,
) -> None:
    """Refuse bad options with a clear ValueError (the CLI calls this before loading anything)."""
    check_decisive_margin(decisive_margin)
    if not ratios:
        raise ValueError("give at least one ratio")
    for ratio in ratios:
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            raise ValueError(f"a recompute ratio must be between 0 and 1, got {ratio}")
    if target_agreement is not None and not 0.0 < target_agreement <= 1.0:
        raise ValueError(f"the target agreement must be in (0, 1], got {target_agreement}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
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


class CheckOptions(TypedDict, total=False):
    """What :meth:`CacheBlendRAG.check` takes beside its questions (defaults: :func:`run_check`'s)."""

    ratios: Sequence[float | None] | None
    method: str | None
    target_agreement: float | None
    max_tokens: int
    sample: int
    top_k: int | None
    decisive_margin: float


def run_check(
    rag: CheckedRAG,
    questions: Sequence[str] | None = None,
    ratios: Sequence[float | None] | None = None,
    method: str | None = None,
    target_agreement: float | None = None,
    max_tokens: int = DEFAULT_CHECK_MAX_TOKENS,
    sample: int = 20,
    top_k: int | None = None,
    decisive_margin: float = DECISIVE_MARGIN,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> CheckReport:
    """See :meth:`CacheBlendRAG.check` (the defaults are ``rag.config``'s). ``progress(done, total)``: after
    each question is answered by every method (and once, with 0 done, before the first)."""
    ratios = list(ratios) if ratios is not None else [rag.config.ratio]
    check_options(ratios, target_agreement, max_tokens, sample, decisive_margin)
    sampled = questions is None
    asked = sample_questions(rag.corpus, sample) if questions is None else clean_questions(questions)
    engine = rag.engine  # scored from what it returns: each answer's diagnostics
    runs = method_runs(engine, named_default(method or DEFAULT_NAME, rag.config.method), ratios)
    sampling = SamplingParams(max_tokens=max_tokens)
    cases = []
    compared_by_case: list[dict[str, MethodRecord]] = []
    if progress is not None:
        progress(0, len(asked))
    for number, question in enumerate(asked):
        chunks = rag.retrieve(question, top_k)
        refs = [ChunkRef(c.token_ids, c.chunk_id) for c in chunks]
        store_in_ram(engine, question, refs, [run.spec for run in runs])
        compared, prompt_tokens = compare_methods(runs, question, refs, sampling, nll_reference=False)
        compared_by_case.append(compared)
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
        if progress is not None:
            progress(number + 1, len(asked))
    table = method_table(compared_by_case, [run.label for run in runs], decisive_margin)
    rows = [_row(run.label, run.spec.ratio, table[run.label], compared_by_case) for run in runs]
    lowest, note, needed = verdict(rows[1:], target_agreement)
    return CheckReport(
        rows=rows,
        questions=asked,
        sampled=sampled,
        target_agreement=target_agreement,
        lowest_ratio_meeting_target=lowest,
        target_note=note,
        max_tokens=max_tokens,
        cases=cases,
        more_questions_needed=needed,
        decisive_margin=decisive_margin,
    )


def _row(
    label: str, ratio: float | None, entry: MethodRow, cases: Sequence[dict[str, MethodRecord]]
) -> CheckRow:
    records = [case[label] for case in cases]
    agreeing = sum(bool(r.first_token_agreement) for r in records)
    low, high = wilson_interval(agreeing, len(records))
    # the very tokens of full prefill's answer: a text compare would also pass a different tokenization
    equal = sum(case[label].answer_tokens == case[REFERENCE].answer_tokens for case in cases)
    equal_low, equal_high = wilson_interval(equal, len(records))
    f1 = entry.agreement_f1 or 0.0
    f1_low, f1_high = wilson_interval(f1 * len(records), len(records))
    # the split's counts come from the table (metrics.agreement_split decides which case is which)
    decisive, decisive_agreeing = entry.decisive_cases or 0, entry.decisive_agreeing or 0
    decisive_low, decisive_high = wilson_interval(decisive_agreeing, decisive)
    return CheckRow(
        label=label,
        ratio=ratio,
        first_token_agreement=entry.first_token_agreement,
        kl_first_token=entry.kl_first_token,
        agreement_f1=entry.agreement_f1,
        ttft_median_s=entry.ttft_median_s,
        speedup_median=entry.speedup_median,
        chunk_recompute_ratio=entry.chunk_recompute_ratio,
        compute_fraction=entry.compute_fraction,
        questions=len(records),
        agreeing=agreeing,
        agreement_low=low,
        agreement_high=high,
        decisive_questions=decisive,
        decisive_agreeing=decisive_agreeing,
        decisive_low=decisive_low,
        decisive_high=decisive_high,
        near_tie_questions=entry.near_tie_cases or 0,
        near_tie_agreeing=entry.near_tie_agreeing or 0,
        answers_equal=equal,
        answer_match=equal / max(1, len(records)),
        answer_match_low=equal_low,
        answer_match_high=equal_high,
        agreement_f1_low=f1_low,
        agreement_f1_high=f1_high,
        budgets=dict(Counter(r.budget.text(brief=True) for r in records if r.budget is not None)),
    )


def wilson_interval(successes: float, trials: int, z: float = CONFIDENCE_Z) -> tuple[float, float]:
    """The Wilson score interval of a proportion (``successes`` of ``trials``): unlike the normal
    approximation it stays inside [0, 1] and is honest at 0 and n successes, where checks mostly are.

    Also the interval of a mean of scores in [0, 1] (F1), ``successes`` then their sum: such a score's
    variance is at most p(1 - p) for a mean p, a 0/1 score's, so the interval is at least as wide as the
    score's own would be (conservative), and equals the proportion's when every score is 0 or 1."""
    if trials <= 0:
        return 0.0, 1.0
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def more_questions_needed(successes: float, trials: int, target: float) -> int | None:
    """About how many more questions, answered at the same agreement rate, would put the whole interval
    on one side of ``target``; None when the rate is the target itself (no number of questions would)."""
    rate = successes / trials if trials else 0.0
    if trials == 0 or rate == target:
        return None

    def settled(n: int) -> bool:
        low, high = wilson_interval(round(rate * n), n)
        return low >= target if rate > target else high < target

    extra = 1
    while not settled(trials + extra):  # doubling, then bisection: the interval narrows monotonically
        extra *= 2
        if extra > _MAX_QUESTIONS_NEEDED:
            return None
    lo, hi = extra // 2, extra
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if settled(trials + mid) else (mid, hi)
    return hi


def verdict(rows: Sequence[CheckRow], target: float | None) -> tuple[float | None, str, int | None]:
    """The lowest ratio whose decisive first-token agreement interval and answer F1 interval both lie
    wholly at or above ``target``, with the reason, or None with the reason; and, when more questions would
    settle a cheaper ratio whose intervals straddle the target, about how many. Among equally good rows the
    cheaper (lower ratio) is named.

    Only decisive questions count for the first token: a near-tie that a method resolves the other way is
    no evidence against it (full prefill's own pick there turns on noise), and would otherwise hold every
    ratio off the target. The answer is read on every question: agreeing first tokens followed by another
    answer are what the first token alone cannot see.
    """
    if target is None:
        return None, "no target agreement given", None
    with_ratio = sorted((r for r in rows if r.ratio is not None), key=lambda r: r.ratio)
    if not with_ratio:
        return None, "the method was run without a recompute ratio", None
    meeting = next((r for r in with_ratio if _meets(r, target)), None)
    cheaper = [r for r in with_ratio if meeting is None or r.ratio < meeting.ratio]
    undecided = next(
        (r for r in cheaper if r.decisive_high >= target and r.agreement_f1_high >= target), None
    )
    needed = None
    if undecided is not None:
        needed = _questions_needed(undecided, target)
        if needed is not None:
            more = f"about {needed} more needed to tell"
        elif not undecided.decisive_questions:
            more = "no decisive question yet: ask more"
        else:
            more = "too close to the target for more questions to tell"
        open_question = f"{undecided.label} ({_evidence(undecided)}): {more}"
    if meeting is not None:
        note = f"{meeting.label}: {_evidence(meeting)}, both whole intervals >= {target}"
        if undecided is not None:
            note += f"; the cheaper {open_question}"
        return meeting.ratio, note, needed
    if undecided is not None:
        return None, f"not enough questions for a verdict on {target}: {open_question}", needed
    # ties on the evidence go to the cheaper ratio: max keeps the first of equals, in ascending ratio order
    best = max(
        with_ratio,
        key=lambda r: (
            min(r.decisive_high, r.agreement_f1_high),
            r.decisive_agreeing / max(1, r.decisive_questions),
            r.agreement_f1,
        ),
    )
    short = [
        *(["decisive first-token agreement"] if best.decisive_high < target else []),
        *(["answer F1"] if best.agreement_f1_high < target else []),
    ]
    note = (
        f"no ratio tried reaches {target} in both decisive first-token agreement and answer F1 (best: "
        f"{best.label}, {_evidence(best)}; short of it: {' and '.join(short)})"
    )
    return None, note + "; try higher ratios", None


def _meets(row: CheckRow, target: float) -> bool:
    """Both whole intervals at or above ``target``, with at least one decisive question."""
    return bool(row.decisive_questions) and min(row.decisive_low, row.agreement_f1_low) >= target


def _questions_needed(row: CheckRow, target: float) -> int | None:
    """More questions that would settle whichever of ``row``'s two intervals straddles the target (the
    more of the two when both do); the decisive count is scaled to questions of all kinds, if this run's
    share of decisive questions holds (the user asks questions, not decisive ones). None without a
    decisive question, or when a rate is the target itself."""
    needs = []
    if not (row.decisive_questions and row.decisive_low >= target):
        decisive = more_questions_needed(row.decisive_agreeing, row.decisive_questions, target)
        if decisive is None:
            return None
        needs.append(math.ceil(decisive * row.questions / row.decisive_questions))
    if row.agreement_f1_low < target:
        answers = more_questions_needed(row.agreement_f1 * row.questions, row.questions, target)
        if answers is None:
            return None
        needs.append(answers)
    return max(needs, default=None)


def _evidence(row: CheckRow) -> str:
    return (
        f"{row.decisive_agreeing}/{row.decisive_questions} decisive first tokens agree, 95% CI "
        f"{row.decisive_low:.2f}-{row.decisive_high:.2f}; answer F1 {row.agreement_f1:.2f}, 95% CI "
        f"{row.agreement_f1_low:.2f}-{row.agreement_f1_high:.2f}, {row.answers_equal}/{row.questions} "
        "answers the same"
    )
