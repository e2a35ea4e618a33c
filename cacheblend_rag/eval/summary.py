"""Summaries of eval results: per-method means (medians for times) over the cases, and the default's claims
evaluated on them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from ..config import DECISIVE_MARGIN
from ..engine.fidelity import REFERENCE, method_table

__all__ = ["REFERENCE", "default_label", "summarize"]

# -- summary -----------------------------------------------------------------------------------------


def summarize(
    results: dict[str, Any],
    labels: Sequence[str] | None = None,
    case_ids: set[int] | None = None,
    decisive_margin: float = DECISIVE_MARGIN,
) -> dict[str, Any]:
    """Per-method means (medians for times) over the cases, first-token agreement split at
    ``decisive_margin`` nats (recorded in the summary, which its tables quote), and the issue's checks."""
    cases = [c for c in results["cases"] if case_ids is None or c["id"] in case_ids]
    if labels is None:
        labels = list(dict.fromkeys(label for c in cases for label in c["methods"]))
    table = method_table(cases, labels, decisive_margin)
    return {
        "cases": len(cases),
        "decisive_margin": decisive_margin,
        "methods": table,
        "checks": _checks(table, results["config"]["task"]),
    }


def _checks(table: dict[str, dict[str, Any]], task: str) -> list[dict[str, Any]]:
    """The claims on the default method (cacheblend at the default ratio), evaluated on this run's
    numbers (pass or fail, with the numbers). Claims whose columns the run lacks are left out."""
    default = default_label()
    blend, reference = table.get(default), table.get(REFERENCE)
    if blend is None or reference is None:
        return []
    reuse, epic = table.get("full_reuse"), table.get("epic")
    checks = [
        _check(
            f"{default} recomputes <= 15% of the cached tokens",
            blend.get("chunk_recompute_ratio", 1.0) <= 0.15 + 1e-9,
            {"chunk_recompute_ratio": blend.get("chunk_recompute_ratio")},
        )
    ]
    if task == "summary":
        gap = reference["gold"] - blend["gold"]
        checks.append(
            _check(
                f"Rouge-L gap of {default} to full_recompute <= 0.02",
                gap <= 0.02,
                {REFERENCE: reference["gold"], default: blend["gold"], "gap": gap},
            )
        )
    else:
        agreement = blend["first_token_agreement"]
        checks.append(_check(f"{default} first-token agreement >= 0.95", agreement >= 0.95, agreement))
    if reuse is not None:
        kl, reuse_kl = blend["kl_first_token"], reuse["kl_first_token"]
        checks.append(
            _check(f"{default} first-token KL <= 0.5 x full_reuse's", kl <= 0.5 * reuse_kl, [kl, reuse_kl])
        )
        nll = [e.get("nll_reference") for e in (blend, reuse, reference)]
        if None not in nll:  # an engine that scores no continuation (vLLM) reports none
            gap, reuse_gap = nll[0] - nll[2], nll[1] - nll[2]
            checks.append(
                _check(
                    f"{default} gap to full prefill in NLL of its answer <= 0.5 x full_reuse's",
                    gap <= 0.5 * reuse_gap,
                    [gap, reuse_gap],
                )
            )
    if epic is not None:
        checks.append(
            _check(
                f"{default} first-token KL below epic's",
                blend["kl_first_token"] < epic["kl_first_token"],
                [blend["kl_first_token"], epic["kl_first_token"]],
            )
        )
    others = [label for label in ("full_reuse", "epic") if label in table]
    if others:
        checks.append(
            _check(
                f"{default} agreement F1 above {' and '.join(others)}",
                all(blend["agreement_f1"] > table[label]["agreement_f1"] for label in others),
                {label: table[label]["agreement_f1"] for label in [default, *others]},
            )
        )
    ratios = sorted(
        (float(e["options"]["ratio"]), e["kl_first_token"])
        for label, e in table.items()
        if label.startswith("cacheblend@") and "ratio" in e.get("options", {}) and len(e["options"]) == 1
    )
    if len(ratios) > 2:
        rises = [b[1] - a[1] for a, b in itertools.pairwise(ratios)]
        checks.append(
            _check(
                "monotone: cacheblend's first-token KL never rises by > 0.02 from one ratio to the next",
                max(rises) <= 0.02,
                {f"{r:g}": round(kl, 4) for r, kl in ratios},
            )
        )
    return checks


def default_label() -> str:
    """The results label of the default method at the default ratio (e.g. ``cacheblend@0.15``)."""
    from ..blend.spec import parse_method
    from ..settings import get_settings

    settings = get_settings()
    return parse_method(settings.method).with_ratio(settings.ratio, where_taken=True).label


def _check(claim: str, passed: bool, detail: Any) -> dict[str, Any]:
    return {"claim": claim, "passed": bool(passed), "detail": detail}
