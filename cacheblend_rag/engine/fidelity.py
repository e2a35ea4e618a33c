"""Methods answered side by side against full prefill, scored for fidelity: the one implementation behind
``cacheblend-rag eval`` (which adds gold scores) and ``CacheBlendRAG.check`` (the user's own corpus).

:func:`compare_methods` answers one prompt (a question over chunks) with the reference method first and
each other method after it, in turn, so their TTFTs are measured side by side; every record holds the
answer, TTFT (building the segments, which includes the KV look-ups, plus fusion and the first token),
the fusion's recompute accounting, and the fidelity metrics against the reference: first-token agreement,
first-token KL, agreement F1 (token F1 with the reference's answer) and, when asked, the teacher-forced
NLL of the reference's answer under the method's fused cache. It reads only what the engine returns
(:class:`~.base.FusionDiagnostics`), so it scores any engine. :func:`method_table` averages records over
prompts (medians for times, the speed-up the median of per-prompt ratios).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..blend.budget_choice import BudgetChoice
from ..blend.methods import Reuse, next_token_lead
from ..blend.spec import MethodSpec
from ..config import DECISIVE_MARGIN
from ..records import JsonRecord
from .base import EngineProtocol
from .metrics import agreement_split, kl_divergence, log_margin, qa_f1
from .prompt import ChunkRef, PromptBuilder
from .request import EdgeTimings, GenerationRequest
from .sampling import SamplingParams

REFERENCE = "full_recompute"  # the column every other method is scored against


@dataclass(frozen=True)
class MethodRun:
    """One column: its label (``cacheblend@0.15``), spec and the engine it runs on (the reference's
    first)."""

    label: str
    spec: MethodSpec
    engine: EngineProtocol


def store_in_ram(
    engine: EngineProtocol, question: str, refs: Sequence[ChunkRef], reuses: Iterable = ()
) -> None:
    """Compute and store whatever KV the methods will reuse (``reuses``: specs or :class:`Reuse` kinds;
    default the chunks and the prompt's prefix), and bring it into the RAM tier, so every method's TTFT
    is measured with its KV in RAM."""
    for reuse in list(reuses) or (Reuse.CHUNKS, Reuse.PREFIX):
        for segment in engine.rag_segments(question, refs, reuse):
            if segment.kv is not None:
                for layer in range(segment.kv.num_layers):  # a chunk read in full is promoted to RAM
                    segment.kv.layer(layer)


def chunk_positions(builder: PromptBuilder, question: str, refs: Sequence[ChunkRef]) -> torch.Tensor:
    """Bool mask over the RAG prompt's positions: True where a retrieved chunk's tokens sit. The layout
    is the same whichever method builds the segments (prefix_cache only regroups them)."""
    prefix, separator, suffix = builder.rag_frame(question)
    mask = [False] * len(prefix)
    for i, ref in enumerate(refs):
        mask += [False] * (len(separator) if i else 0) + [True] * len(ref.token_ids)
    return torch.tensor(mask + [False] * len(suffix))


def chunk_recompute_ratio(
    positions: Sequence[int] | None, prompt_tokens: int, chunk_mask: torch.Tensor
) -> float | None:
    """Share of the retrieved chunks' tokens recomputed at the last layer (comparable across methods:
    ``recompute_ratio`` counts only segments a method treats as cached, e.g. just the prefix for
    prefix_cache); None when the engine did not report the positions it recomputed."""
    if positions is None:
        return None
    if chunk_mask.numel() != prompt_tokens:
        raise ValueError(f"chunk mask covers {chunk_mask.numel()} positions, the prompt {prompt_tokens}")
    selected = torch.tensor(list(positions), dtype=torch.long)
    return float(chunk_mask[selected].sum()) / max(1, int(chunk_mask.sum()))


@dataclass(frozen=True, kw_only=True)
class MethodRecord(JsonRecord):
    """One method's answer to one prompt and its scores against the reference (see the module's doc): what
    a results file holds per case and method. ``None``: not measured (an engine that does not report it, or
    a score not asked for), and left out of the file."""

    answer: str
    answer_tokens: list[int]
    finish_reason: str
    ttft_s: float
    segments_s: float
    fusion_s: float | None = None
    load_wait_s: float
    total_s: float
    recompute_ratio: float
    chunk_recompute_ratio: float | None = None
    compute_fraction: float | None = None
    reused_tokens: int
    computed_tokens: int
    first_token: int
    agreement_f1: float
    first_token_agreement: bool
    kl_first_token: float
    nll_reference: float | None = None
    # how sure the method's first token was: its probability minus the runner-up's (full reuse's is what
    # cacheblend's budget=margin reads from its probe); results recorded before it lack it
    first_token_margin: float | None = None
    # full prefill's top first-token log-probability minus its runner-up's, in nats (the same for every
    # method of a case): the threshold splitting decisive cases from near-ties is applied when records are
    # summarised (metrics.agreement_split), so a results file can be read again at another; results
    # recorded before the split lack it
    reference_margin: float | None = None
    # eval's scores against the gold answers
    gold: float | None = None
    nll_gold: float | None = None
    agreement_rouge_l: float | None = None  # summaries only
    options: dict[str, Any] | None = None  # the spec's options (a plain method has none)
    # the budget the method chose for this prompt's chunks, when it chooses one per request
    budget: BudgetChoice | None = None


@dataclass(frozen=True)
class _Reference:
    text: str
    ids: list[int]
    logprobs: torch.Tensor


def compare_methods(
    runs: Sequence[MethodRun],
    question: str,
    refs: Sequence[ChunkRef],
    sampling: SamplingParams,
    continuation: Sequence[int] | None = None,
    nll_reference: bool = True,
) -> tuple[dict[str, MethodRecord], int]:
    """Answer ``question`` over ``refs`` with each of ``runs`` in turn (the reference first) and score each
    against the reference from what its engine returns (:class:`~.base.FusionDiagnostics`); returns the
    records by label and the prompt's length in tokens. ``continuation``: a token sequence (eval's gold
    answer) whose NLL after each method's prompt goes in the record's ``nll_gold``; ``nll_reference``:
    score the reference's answer under each method's prompt too (where the engine scores continuations)."""
    if not runs or runs[0].label != REFERENCE:
        raise ValueError(f"{REFERENCE} must be the first method: it is the reference of the others")
    chunk_mask = chunk_positions(runs[0].engine.prompts, question, refs)
    reference: _Reference | None = None
    records: dict[str, MethodRecord] = {}
    prompt_tokens = 0
    for run in runs:
        engine = run.engine
        t0 = time.perf_counter()
        segments = engine.rag_segments(question, refs, run.spec)
        segments_s = time.perf_counter() - t0
        scored = [] if continuation is None else [tuple(continuation)]
        if nll_reference and reference is not None:
            scored.append(tuple(reference.ids))
        asked = replace(sampling, diagnostics=True, score_continuations=tuple(scored))
        # submitted as every user's request is (the engine's one entry), timed from before its prompt
        # was laid out: full prefill and each method counted alike
        edge = EdgeTimings(prompt_s=segments_s)
        result = engine.submit(GenerationRequest(segments, run.spec.build(), asked, t0, edge)).result()
        diagnostics = result.diagnostics
        if diagnostics is None:
            raise ValueError(f"the {type(engine).__name__} returned no diagnostics: it cannot be scored")
        prompt_tokens = result.prompt_tokens
        if reference is None:
            reference = _Reference(result.text, result.token_ids, diagnostics.first_token_logprobs)
        # (gold, reference's answer), each when asked for; None where the engine scores none
        scores = [*diagnostics.continuation_nll, None, None][: max(1, len(scored))]
        ref_nll = diagnostics.answer_nll if run.label == REFERENCE else scores[-1]  # its own: as chosen
        records[run.label] = MethodRecord(
            answer=result.text,
            answer_tokens=result.token_ids,
            finish_reason=result.finish_reason,
            ttft_s=result.ttft_s,
            segments_s=segments_s,
            fusion_s=diagnostics.fusion_s,
            load_wait_s=result.load_wait_s,
            total_s=result.total_s,
            recompute_ratio=result.recompute_ratio,
            chunk_recompute_ratio=chunk_recompute_ratio(
                diagnostics.recomputed_positions, result.prompt_tokens, chunk_mask
            ),
            compute_fraction=diagnostics.compute_fraction,
            reused_tokens=result.reused_tokens,
            computed_tokens=result.computed_tokens,
            first_token=int(diagnostics.first_token_logprobs.argmax()),
            agreement_f1=qa_f1(result.text, [reference.text]),
            first_token_agreement=bool(
                int(diagnostics.first_token_logprobs.argmax()) == int(reference.logprobs.argmax())
            ),
            kl_first_token=kl_divergence(reference.logprobs, diagnostics.first_token_logprobs),
            nll_reference=ref_nll if nll_reference else None,
            first_token_margin=next_token_lead(diagnostics.first_token_logprobs),
            reference_margin=log_margin(reference.logprobs),
            nll_gold=scores[0] if continuation is not None else None,
            options=dict(run.spec.options) if run.spec.options else None,
            budget=result.budget,
        )
    return records, prompt_tokens


@dataclass(frozen=True, kw_only=True)
class MethodRow(JsonRecord):
    """One method over a set of prompts (:func:`method_table`): what a results file's summary holds per
    method. A mean is None where no prompt had the measure (left out of the file)."""

    cases: int
    gold: float | None = None
    agreement_f1: float | None = None
    agreement_rouge_l: float | None = None  # summaries only
    first_token_agreement: float | None = None
    kl_first_token: float | None = None
    nll_gold: float | None = None
    nll_reference: float | None = None
    recompute_ratio: float | None = None
    chunk_recompute_ratio: float | None = None
    budget_ratio: float | None = None  # the share of the cached tokens the budget chose (its records')
    compute_fraction: float | None = None
    # first-token agreement on decisive cases and on near-ties (metrics.agreement_split); summaries of
    # records without full prefill's margin (results recorded before the split) lack them
    decisive_cases: int | None = None
    decisive_agreeing: int | None = None
    first_token_agreement_decisive: float | None = None  # None: no decisive case
    near_tie_cases: int | None = None
    near_tie_agreeing: int | None = None
    first_token_agreement_near_tie: float | None = None
    ttft_median_s: float
    ttft_mean_s: float
    speedup_median: float | None = None  # None: no prompt has the reference's record beside this one
    options: dict[str, Any] | None = None


def method_table(
    cases: Sequence[Mapping[str, MethodRecord]],
    labels: Sequence[str],
    decisive_margin: float = DECISIVE_MARGIN,
) -> dict[str, MethodRow]:
    """Per label over ``cases`` (each case's records by label): the means of the scores, first-token
    agreement on decisive cases (full prefill's margin >= ``decisive_margin`` nats) and near-ties
    (:func:`~.metrics.agreement_split`), the median and mean TTFT, and the median per-case speed-up over
    the reference (times are summarised by their median)."""
    table: dict[str, MethodRow] = {}
    for label in labels:
        rows = [c[label] for c in cases if label in c]
        if not rows:
            continue
        speedups = [c[REFERENCE].ttft_s / c[label].ttft_s for c in cases if label in c and REFERENCE in c]
        table[label] = MethodRow(
            cases=len(rows),
            gold=_mean(r.gold for r in rows),
            agreement_f1=_mean(r.agreement_f1 for r in rows),
            agreement_rouge_l=_mean(r.agreement_rouge_l for r in rows),
            first_token_agreement=_mean(r.first_token_agreement for r in rows),
            kl_first_token=_mean(r.kl_first_token for r in rows),
            nll_gold=_mean(r.nll_gold for r in rows),
            nll_reference=_mean(r.nll_reference for r in rows),
            recompute_ratio=_mean(r.recompute_ratio for r in rows),
            chunk_recompute_ratio=_mean(r.chunk_recompute_ratio for r in rows),
            budget_ratio=_mean(r.budget.ratio if r.budget else None for r in rows),
            compute_fraction=_mean(r.compute_fraction for r in rows),
            **agreement_split(rows, decisive_margin),
            ttft_median_s=statistics.median(r.ttft_s for r in rows),
            ttft_mean_s=statistics.fmean(r.ttft_s for r in rows),
            speedup_median=statistics.median(speedups) if speedups else None,
            options=rows[0].options or None,
        )
    return table


def _mean(values: Iterable[float | None]) -> float | None:
    """The mean of the values measured; None when none was."""
    measured = [float(v) for v in values if v is not None]
    return statistics.fmean(measured) if measured else None
