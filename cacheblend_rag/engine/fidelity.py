"""Methods answered side by side against full prefill, scored for fidelity: the one implementation behind
``cacheblend-rag eval`` (which adds gold scores) and ``CacheBlendRAG.check`` (the user's own corpus).

:func:`compare_methods` answers one prompt (a question over chunks) with the reference method first and
each other method after it, in turn, so their TTFTs are measured side by side; every record holds the
answer, TTFT (building the segments, which includes the KV look-ups, plus fusion and the first token),
the fusion's recompute accounting, and the fidelity metrics against the reference: first-token agreement,
first-token KL, agreement F1 (token F1 with the reference's answer) and, when asked, the teacher-forced
NLL of the reference's answer under the method's fused cache. :func:`method_table` averages records over
prompts (medians for times, the speed-up the median of per-prompt ratios).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..blend.fusor import FusionResult
from ..blend.methods import Reuse
from ..blend.spec import MethodSpec
from .engine import Engine
from .metrics import continuation_nll, kl_divergence, qa_f1
from .prompt import ChunkRef, PromptBuilder
from .sampling import SamplingParams

REFERENCE = "full_recompute"  # the column every other method is scored against

# record fields averaged over prompts by method_table (times are summarised by their median)
MEAN_FIELDS = (
    "gold",
    "agreement_f1",
    "agreement_rouge_l",
    "first_token_agreement",
    "kl_first_token",
    "nll_gold",
    "nll_reference",
    "recompute_ratio",
    "chunk_recompute_ratio",
    "compute_fraction",
)


class RecordingEngine(Engine):
    """The engine, keeping the last :class:`FusionResult` so its cache and logits can be scored after
    generation (generation writes only past the prompt's slots)."""

    last_fusion: FusionResult | None = None

    def fuse(self, segments, method, extra_capacity=0, observer=None) -> FusionResult:
        self.last_fusion = super().fuse(segments, method, extra_capacity, observer)
        return self.last_fusion


@dataclass(frozen=True)
class MethodRun:
    """One column: its label (``cacheblend@0.15``), spec and the engine it runs on (the reference's
    first)."""

    label: str
    spec: MethodSpec
    engine: RecordingEngine


def store_in_ram(engine: Engine, question: str, refs: Sequence[ChunkRef], reuses: Iterable = ()) -> None:
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


def chunk_recompute_ratio(fusion: FusionResult, chunk_mask: torch.Tensor) -> float:
    """Share of the retrieved chunks' tokens recomputed at the last layer (comparable across methods:
    ``recompute_ratio`` counts only segments a method treats as cached, e.g. just the prefix for
    prefix_cache)."""
    if chunk_mask.numel() != fusion.num_tokens:
        raise ValueError(f"chunk mask covers {chunk_mask.numel()} positions, the prompt {fusion.num_tokens}")
    return float(chunk_mask[fusion.selected].sum()) / max(1, int(chunk_mask.sum()))


# what a caller adds to each record while the method's fused cache is still there: (run, answer, fusion)
Extra = Callable[[MethodRun, Any, FusionResult], dict[str, Any]]


def compare_methods(
    runs: Sequence[MethodRun],
    question: str,
    refs: Sequence[ChunkRef],
    sampling: SamplingParams,
    extra: Extra | None = None,
    nll_reference: bool = True,
) -> tuple[dict[str, dict[str, Any]], int]:
    """Answer ``question`` over ``refs`` with each of ``runs`` in turn (the reference first) and score each
    against the reference; returns the records by label and the prompt's length in tokens."""
    if not runs or runs[0].label != REFERENCE:
        raise ValueError(f"{REFERENCE} must be the first method: it is the reference of the others")
    chunk_mask = chunk_positions(runs[0].engine.prompts, question, refs)
    reference: dict[str, Any] = {}
    records: dict[str, dict[str, Any]] = {}
    prompt_tokens = 0
    for run in runs:
        engine = run.engine
        t0 = time.perf_counter()
        segments = engine.rag_segments(question, refs, run.spec)
        segments_s = time.perf_counter() - t0
        result = engine.generate(segments, run.spec.build(), sampling)
        fusion = engine.last_fusion
        assert fusion is not None
        prompt_tokens = fusion.num_tokens
        if run.label == REFERENCE:
            reference = {"text": result.text, "ids": result.token_ids, "logits": fusion.logits}
        record = _record(run, result, fusion, segments_s, reference, chunk_mask, nll_reference)
        if extra is not None:
            record.update(extra(run, result, fusion))
        records[run.label] = record
        engine.last_fusion = None
    return records, prompt_tokens


def _record(
    run: MethodRun,
    result,
    fusion: FusionResult,
    segments_s: float,
    reference: dict[str, Any],
    chunk_mask: torch.Tensor,
    nll_reference: bool,
) -> dict[str, Any]:
    first_token = int(fusion.logits.argmax())
    record = {
        "answer": result.text,
        "answer_tokens": result.token_ids,
        "finish_reason": result.finish_reason,
        "ttft_s": segments_s + result.ttft_s,
        "segments_s": segments_s,
        "fusion_s": fusion.seconds,
        "load_wait_s": fusion.load_wait_s,
        "total_s": segments_s + result.total_s,
        "recompute_ratio": fusion.recompute_ratio,
        "chunk_recompute_ratio": chunk_recompute_ratio(fusion, chunk_mask),
        "compute_fraction": fusion.compute_fraction,
        "reused_tokens": fusion.reused_tokens,
        "computed_tokens": fusion.computed_tokens,
        "first_token": first_token,
        "agreement_f1": qa_f1(result.text, [reference["text"]]),
        "first_token_agreement": first_token == int(reference["logits"].argmax()),
        "kl_first_token": kl_divergence(reference["logits"], fusion.logits),
    }
    if nll_reference:
        model = run.engine.model
        record["nll_reference"] = continuation_nll(
            model, fusion.cache, fusion.num_tokens, fusion.logits, reference["ids"]
        )
    if run.spec.options:
        record["options"] = dict(run.spec.options)
    return record


def method_table(cases: Sequence[dict[str, Any]], labels: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per label over ``cases`` (each with its records under ``"methods"``): the means of
    :data:`MEAN_FIELDS`, the median and mean TTFT, and the median per-case speed-up over the reference."""
    table: dict[str, dict[str, Any]] = {}
    for label in labels:
        rows = [c["methods"][label] for c in cases if label in c["methods"]]
        if not rows:
            continue
        entry: dict[str, Any] = {"cases": len(rows)}
        for name in MEAN_FIELDS:
            values = [float(r[name]) for r in rows if r.get(name) is not None]
            if values:
                entry[name] = statistics.fmean(values)
        entry["ttft_median_s"] = statistics.median(r["ttft_s"] for r in rows)
        entry["ttft_mean_s"] = statistics.fmean(r["ttft_s"] for r in rows)
        speedups = [
            c["methods"][REFERENCE]["ttft_s"] / c["methods"][label]["ttft_s"]
            for c in cases
            if label in c["methods"] and REFERENCE in c["methods"]
        ]
        if speedups:
            entry["speedup_median"] = statistics.median(speedups)
        options = rows[0].get("options")
        if options:
            entry["options"] = options
        table[label] = entry
    return table
