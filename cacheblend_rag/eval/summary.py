"""Summaries of eval results: per-method means (medians for times) over the cases, and issue 7's claims
evaluated on them."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

REFERENCE = "full_recompute"  # the column every other method is scored against

# -- summary -----------------------------------------------------------------------------------------

_MEAN_FIELDS = (
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


def summarize(
    results: dict[str, Any], labels: Sequence[str] | None = None, case_ids: set[int] | None = None
) -> dict[str, Any]:
    """Per-method means (medians for times) over the cases, and the issue's checks on them."""
    cases = [c for c in results["cases"] if case_ids is None or c["id"] in case_ids]
    if labels is None:
        labels = list(dict.fromkeys(label for c in cases for label in c["methods"]))
    table: dict[str, dict[str, Any]] = {}
    for label in labels:
        rows = [c["methods"][label] for c in cases if label in c["methods"]]
        if not rows:
            continue
        entry: dict[str, Any] = {"cases": len(rows)}
        for name in _MEAN_FIELDS:
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
    return {"cases": len(cases), "methods": table, "checks": _checks(table, results["config"]["task"])}


def _checks(table: dict[str, dict[str, Any]], task: str) -> list[dict[str, Any]]:
    """Issue 7's claims, evaluated on this run's numbers (pass or fail, with the numbers)."""
    blend, reference, reuse = table.get("cacheblend@0.15"), table.get(REFERENCE), table.get("full_reuse")
    if blend is None or reference is None:
        return []
    checks = []
    cheap = {
        label: entry
        for label, entry in table.items()
        if label != REFERENCE and entry.get("chunk_recompute_ratio", 1.0) <= 0.2 + 1e-9
    }
    best = max(cheap, key=lambda label: cheap[label]["agreement_f1"])
    checks.append(
        {
            "claim": "cacheblend@0.15 has the best agreement F1 of the methods recomputing <= 20% of tokens",
            "passed": cheap[best]["agreement_f1"] <= blend["agreement_f1"] + 1e-12,
            "detail": {label: round(e["agreement_f1"], 4) for label, e in cheap.items()},
        }
    )
    gap = reference["gold"] - blend["gold"]
    checks.append(
        {
            "claim": f"gold {'Rouge-L' if task == 'summary' else 'F1'} gap of cacheblend@0.15 to "
            "full_recompute <= 0.02",
            "passed": gap <= 0.02,
            "detail": {"full_recompute": reference["gold"], "cacheblend@0.15": blend["gold"], "gap": gap},
        }
    )
    if reuse is not None:
        checks.append(
            {
                "claim": "full_reuse is worse than cacheblend@0.15 on agreement and on the NLL of the "
                "full_recompute answer",
                "passed": reuse["agreement_f1"] < blend["agreement_f1"]
                and reuse.get("nll_reference", 0.0) > blend.get("nll_reference", 0.0),
                "detail": {
                    "agreement_f1": [reuse["agreement_f1"], blend["agreement_f1"]],
                    "nll_reference": [reuse.get("nll_reference"), blend.get("nll_reference")],
                },
            }
        )
    return checks
