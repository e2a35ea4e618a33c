"""``cacheblend-rag tune``: named variants of the blend on a development split, in one table.

The sweep that chose the default method (docs/fusor.md): where chunk KV is precomputed (behind the
neutral chunk context or alone), which tokens the budget buys (query attention or HKVD), the deviation
signal and the check-layer schedule, against full reuse and EPIC. Every row is scored against full
prefill on the same prompts by the eval harness.
"""

from __future__ import annotations

from pathlib import Path

from .markdown import fmt, machine_line, table
from .records import EvalResults
from .report import SPLIT_HEADER, selection, split_cells, split_note

# The variants that chose the defaults (docs/fusor.md); `none:` marks chunk KV precomputed alone. Every
# cacheblend row has the chunk-shift correction (methods revision 2) but the last, the default without it
# (revision 1's sweep: docs/notes/results/tune-musique-512-rev1.json).
DEFAULT_VARIANTS = (
    "none:full_reuse",
    "full_reuse",
    "none:epic",
    "epic",
    "none:cacheblend_hkvd@0.15",
    "cacheblend_hkvd@0.15",
    "cacheblend_hkvd@ratio=0.15,signal=v",
    "cacheblend_hkvd@ratio=0.15,schedule=[[2,1.0]]",
    "cacheblend_hkvd@ratio=0.15,schedule=[[1,2.0],[3,1.0]]",
    "none:cacheblend@0.15",
    "cacheblend@ratio=0.15,score=attention",
    "cacheblend@0.1",
    "cacheblend@0.12",
    "cacheblend@0.15",
    "cacheblend@0.3",
    "cacheblend@ratio=0.15,shift=false",
)


def tune_section_name(results: EvalResults) -> str:
    return f"tune-{results.config.dataset}-{results.config.chunk_tokens}"


def render_tune(results: EvalResults) -> str:
    """The sweep's table: one row per variant, scored against full prefill."""
    config, summary = results.config, results.summarized()
    gold = "Rouge-L" if config.task == "summary" else "F1"
    rows = [
        [
            f"`{label}`",
            fmt(e.chunk_recompute_ratio, 3),
            fmt(e.ttft_median_s, 2),
            fmt(e.kl_first_token),
            fmt(e.first_token_agreement, 2),
            *split_cells(e),
            fmt(e.agreement_f1),
            fmt(e.nll_reference),
            fmt(e.gold),
        ]
        for label, e in summary.methods.items()
    ]
    header = [
        "variant",
        "cached tokens recomputed",
        "TTFT median (s)",
        "first-token KL",
        "first-token agreement",
        *SPLIT_HEADER,
        "agreement F1",
        "NLL of the full-prefill answer",
        f"gold {gold}",
    ]
    return "\n".join(
        [
            f"#### Sweep: {config.dataset}, {summary.cases} cases, chunks of <= "
            f"{config.chunk_tokens} tokens, {config.top_k} per prompt",
            "",
            "```bash",
            *dict.fromkeys(results.commands),
            "```",
            "",
            f"Machine: {machine_line(results.machine)}. Cases `{selection(config)}` of "
            f"`{Path(config.dataset_path).name}`; chunk KV behind the {config.chunk_context} chunk "
            "context unless the label starts with `none:` (chunks prefilled alone). Means over cases (TTFT: "
            "median); KL is KL(full prefill || variant) of the first-token distribution, agreement compares "
            f"with the full-prefill answer (first-token agreement split into {split_note(summary)}), NLL is "
            "per token, teacher-forced.",
            "",
            table(header, rows),
        ]
    )
