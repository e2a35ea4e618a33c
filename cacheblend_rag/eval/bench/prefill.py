"""Section ``prefill``: our layer-wise full prefill against ``transformers``' forward on the same ids."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ...records import OpenRecord
from ..markdown import fmt, table
from .config import BenchContext
from .page import Page, checks_lines
from .record import Check


@dataclass(frozen=True)
class PrefillResult(OpenRecord):
    """Median seconds of each side over ``repeats`` interleaved runs, every sample, and how far apart
    their last logits are."""

    tokens: int
    repeats: int
    ours_s: float
    transformers_s: float
    samples: dict[str, list[float]]
    ratio_ours_over_transformers: float
    max_abs_logit_diff: float
    checks: list[Check]


@torch.inference_mode()
def section_prefill(ctx: BenchContext) -> PrefillResult:
    """Our full prefill vs ``transformers``' forward on the same ids, interleaved."""
    model, ids = ctx.model, ctx.text_ids[: ctx.config.prefill_tokens]
    ours, theirs = [], []
    model.prefill(ids[:64])  # warm-up
    ours_logits = theirs_logits = None
    for _ in range(ctx.config.repeats):
        started = time.perf_counter()
        ours_logits, _ = model.prefill(ids)
        ours.append(time.perf_counter() - started)
        started = time.perf_counter()
        out = model.hf_model(input_ids=torch.tensor([ids], device=model.device), logits_to_keep=1)
        theirs.append(time.perf_counter() - started)
        theirs_logits = out.logits[:, -1].float()
    ratio = statistics.median(ours) / statistics.median(theirs)
    return PrefillResult(
        tokens=len(ids),
        repeats=ctx.config.repeats,
        ours_s=statistics.median(ours),
        transformers_s=statistics.median(theirs),
        samples={"ours_s": ours, "transformers_s": theirs},
        ratio_ours_over_transformers=ratio,
        max_abs_logit_diff=float((ours_logits - theirs_logits).abs().max()),
        checks=[Check("our full prefill <= 1.1x transformers", ratio <= 1.1, ratio)],
    )


def render_prefill(page: Page, pre: PrefillResult) -> list[str]:
    return [
        table(
            ["tokens", "ours (s)", "transformers (s)", "ours / transformers", "max |logit diff|"],
            [
                [
                    pre.tokens,
                    fmt(pre.ours_s),
                    fmt(pre.transformers_s),
                    fmt(pre.ratio_ours_over_transformers, 3),
                    f"{pre.max_abs_logit_diff:.1e}",
                ]
            ],
        ),
        "",
        f"Median of {pre.repeats} interleaved runs; transformers computes only the last position's logits.",
        "",
        checks_lines(pre.checks),
    ]
