"""Section ``prefill``: our layer-wise full prefill against ``transformers``' forward on the same ids."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from .config import BenchContext


@torch.inference_mode()
def section_prefill(ctx: BenchContext) -> dict[str, Any]:
    """Issue 2: our full prefill vs ``transformers``' forward on the same ids, interleaved."""
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
    return {
        "tokens": len(ids),
        "repeats": ctx.config.repeats,
        "ours_s": statistics.median(ours),
        "transformers_s": statistics.median(theirs),
        "samples": {"ours_s": ours, "transformers_s": theirs},
        "ratio_ours_over_transformers": ratio,
        "max_abs_logit_diff": float((ours_logits - theirs_logits).abs().max()),
        "checks": [
            {"claim": "our full prefill <= 1.1x transformers", "passed": ratio <= 1.1, "value": ratio}
        ],
    }
