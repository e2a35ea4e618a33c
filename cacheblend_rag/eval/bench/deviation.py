"""Section ``deviation``: attention and KV deviation against full prefill vs the recompute ratio on real
RAG prompts (MuSiQue questions with their top-k retrieved chunks), with epic and full_reuse beside it."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from ...blend.diagnostics import measure_deviation
from ...blend.methods import Reuse
from ...blend.spec import parse_method
from ...records import OpenRecord
from ..markdown import fmt, table
from .config import BenchContext
from .page import Page, checks_lines
from .prompts import eval_engine, rag_prompts
from .record import Check


@dataclass(frozen=True)
class MethodDeviation(OpenRecord):
    """One method's deviation, averaged over layers then prompts, and its share of tokens recomputed;
    ``ratio`` is the method's recompute ratio (None for the methods without one)."""

    attention: float
    kv: float
    recompute_ratio: float
    ratio: float | None


@dataclass(frozen=True)
class DeviationResult(OpenRecord):
    """The summary per method label, and every prompt's numbers (per layer too) as measured."""

    prompts: int
    ratios: list[float]
    epic_matched_k: int
    summary: dict[str, MethodDeviation]
    per_prompt: list[dict[str, Any]]
    checks: list[Check]


def section_deviation(ctx: BenchContext) -> DeviationResult:
    """Attention/KV deviation vs ratio, with epic (k=16 and k matched to the ratio's cost) and
    full_reuse beside it, on real multi-chunk prompts."""
    config = ctx.config
    engine = eval_engine(ctx)
    try:
        prompts = rag_prompts(engine, config, config.deviation_prompts)
        cached = [sum(len(r.token_ids) for r in p.refs) / len(p.refs) for p in prompts]
        # EPIC recomputing as many tokens per chunk as cacheblend does at config.ratio
        matched_k = max(1, round(config.ratio * statistics.fmean(cached)))
        labels = [f"cacheblend@{r:g}" for r in config.deviation_ratios]
        labels += ["epic@16", f"epic@{matched_k}", "full_reuse"]
        specs = [parse_method(label) for label in labels]
        per_prompt = []
        for prompt in prompts:
            segments = engine.rag_segments(prompt.question, prompt.refs, Reuse.CHUNKS)
            deviations = measure_deviation(engine.fusor, segments, [s.build() for s in specs])
            per_prompt.append(
                {
                    "case": prompt.case_id,
                    "prompt_tokens": sum(len(s) for s in segments),
                    "methods": {
                        spec.label: {
                            "attention": d.mean_attention,
                            "kv": d.mean_kv,
                            "recompute_ratio": d.recompute_ratio,
                            "attention_per_layer": d.attention,
                        }
                        for spec, d in zip(specs, deviations, strict=True)
                    },
                }
            )
    finally:
        engine.store.close()
    summary = {}
    for spec in specs:
        rows = [p["methods"][spec.label] for p in per_prompt]
        summary[spec.label] = MethodDeviation(
            attention=statistics.fmean(r["attention"] for r in rows),
            kv=statistics.fmean(r["kv"] for r in rows),
            recompute_ratio=statistics.fmean(r["recompute_ratio"] for r in rows),
            ratio=spec.ratio,
        )
    return DeviationResult(
        prompts=len(per_prompt),
        ratios=list(config.deviation_ratios),
        epic_matched_k=matched_k,
        summary=summary,
        per_prompt=per_prompt,
        checks=_deviation_checks(summary, config.ratio, matched_k),
    )


def _deviation_checks(summary: dict[str, MethodDeviation], ratio: float, matched_k: int) -> list[Check]:
    blend = summary.get(f"cacheblend@{ratio:g}")
    if blend is None:
        return []
    checks = []
    curve = [(e.ratio, e.attention) for e in summary.values() if e.ratio is not None]
    if len(curve) >= 2:
        lowest, highest = min(curve), max(curve)
        checks.append(
            Check(
                f"attention deviation falls as r rises from {lowest[0]:g} to {highest[0]:g}",
                highest[1] < lowest[1],
                lowest[1] / highest[1] if highest[1] > 0 else math.inf,
            )
        )
    for other in ("epic@16", f"epic@{matched_k}", "full_reuse"):
        if other in summary:
            checks.append(
                Check(
                    f"cacheblend@{ratio:g} deviates less than {other}",
                    blend.attention < summary[other].attention,
                    summary[other].attention / blend.attention,
                )
            )
    return checks


def render_deviation(page: Page, dev: DeviationResult) -> list[str]:
    return [
        f"{dev.prompts} real RAG prompts (MuSiQue questions with their retrieved chunks). Deviation "
        "against full prefill, averaged over layers then prompts: attention = L2 distance of the "
        "question tokens' attention rows; KV = relative L2 distance of the prompt's K and V. "
        f"`epic@{dev.epic_matched_k}` recomputes as many tokens per chunk as cacheblend at r = 0.15.",
        "",
        table(
            ["method", "tokens recomputed", "attention deviation", "KV deviation"],
            [
                [f"`{label}`", fmt(e.recompute_ratio, 3), fmt(e.attention, 4), fmt(e.kv, 4)]
                for label, e in dev.summary.items()
            ],
        ),
        "",
        checks_lines(dev.checks),
        *page.plot("deviation", "attention deviation vs ratio"),
    ]
