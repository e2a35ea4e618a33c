"""Summaries of eval results: per-method means (medians for times) over the cases, and the default's claims
evaluated on them."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from typing import Any

from ..blend.methods import Epic, FullReuse
from ..blend.spec import MethodSpec
from ..config import DECISIVE_MARGIN
from ..engine.fidelity import REFERENCE, MethodRow, method_table
from ..errors import MethodOptionError
from .records import CaseRecord, Check, EvalSummary
from .variants import run_spec

__all__ = ["REFERENCE", "default_label", "default_spec", "label_spec", "summarize"]

# -- summary -----------------------------------------------------------------------------------------


def summarize(
    cases: Sequence[CaseRecord],
    task: str,
    labels: Sequence[str] | None = None,
    case_ids: set[int] | None = None,
    decisive_margin: float = DECISIVE_MARGIN,
) -> EvalSummary:
    """Per-method means (medians for times) over ``cases`` (those of ``case_ids``, when given) of a
    ``task`` run, first-token agreement split at ``decisive_margin`` nats (recorded in the summary, which
    its tables quote), and the default's claims."""
    chosen = [c for c in cases if case_ids is None or c.id in case_ids]
    if labels is None:
        labels = list(dict.fromkeys(label for c in chosen for label in c.methods))
    table = method_table([c.methods for c in chosen], labels, decisive_margin)
    return EvalSummary(
        cases=len(chosen), decisive_margin=decisive_margin, methods=table, checks=_checks(table, task)
    )


def _checks(table: dict[str, MethodRow], task: str) -> list[Check]:
    """The claims on the default method (cacheblend at the default ratio), evaluated on this run's
    numbers (pass or fail, with the numbers). Claims whose columns the run lacks are left out."""
    spec, default_ratio = _default_run()
    default = spec.label
    blend, reference = table.get(default), table.get(REFERENCE)
    if blend is None or reference is None:
        return []
    # the plain full reuse and EPIC columns, which the claims compare the default with
    specs = [(label, label_spec(label)) for label in table]
    plain = {spec.method_class: label for label, spec in specs if spec is not None and not spec.options}
    others = [plain[method] for method in (FullReuse, Epic) if method in plain]
    reuse, epic = (table[plain[method]] if method in plain else None for method in (FullReuse, Epic))
    recomputed = blend.chunk_recompute_ratio
    # the share its budget chose (more where chunks are short); records without one: the default ratio
    chosen = blend.budget_ratio if blend.budget_ratio is not None else default_ratio
    checks = [
        _check(
            f"{default} recomputes no more of the cached tokens than its budget chose "
            f"({chosen:.0%} on average)",
            (1.0 if recomputed is None else recomputed) <= chosen + 1e-9,
            {"chunk_recompute_ratio": recomputed, "budget_ratio": chosen},
        )
    ]
    if task == "summary":
        gap = reference.gold - blend.gold
        checks.append(
            _check(
                f"Rouge-L gap of {default} to full_recompute <= 0.02",
                gap <= 0.02,
                {REFERENCE: reference.gold, default: blend.gold, "gap": gap},
            )
        )
    else:
        agreement = blend.first_token_agreement
        checks.append(_check(f"{default} first-token agreement >= 0.95", agreement >= 0.95, agreement))
    if reuse is not None:
        kl, reuse_kl = blend.kl_first_token, reuse.kl_first_token
        checks.append(
            _check(f"{default} first-token KL <= 0.5 x full_reuse's", kl <= 0.5 * reuse_kl, [kl, reuse_kl])
        )
        nll = [e.nll_reference for e in (blend, reuse, reference)]
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
                blend.kl_first_token < epic.kl_first_token,
                [blend.kl_first_token, epic.kl_first_token],
            )
        )
    if others:
        checks.append(
            _check(
                f"{default} agreement F1 above {' and '.join(others)}",
                all(blend.agreement_f1 > table[label].agreement_f1 for label in others),
                {label: table[label].agreement_f1 for label in [default, *others]},
            )
        )
    # the default method's plain ratio sweep: its columns that set the ratio and nothing else
    method = default_spec().method_class
    ratios = sorted(
        (float(spec.ratio), row.kl_first_token)
        for label, row in table.items()
        if (spec := label_spec(label)) is not None
        and spec.method_class is method
        and spec.ratio is not None
        and len(spec.options) == 1
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


def default_spec() -> MethodSpec:
    """The default method at the default ratio, as the settings name them."""
    return _default_run()[0]


def _default_run() -> tuple[MethodSpec, float]:
    """The default's spec as eval runs it and its ratio (the settings' where the spec names none)."""
    from ..settings import get_settings

    settings = get_settings()
    spec = run_spec(MethodSpec.parse(settings.method), settings.ratio)
    return spec, float(settings.ratio if spec.ratio is None else spec.ratio)


def default_label() -> str:
    """The results label of the default method at the default ratio (e.g. ``cacheblend@0.15``)."""
    return default_spec().label


def label_spec(label: str) -> MethodSpec | None:
    """The method spec a results column's label names, or None where the label is not a plain spec: a
    variant's (``none:epic``, ``int8:cacheblend@0.15``) or one no method registered now takes. Labels of
    older spellings read as the method they name now (``cacheblend@ratio=0.15,selection=hkvd``: the
    cacheblend_hkvd method), without the deprecation warning meant for a user's spec."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return MethodSpec.parse(label)
        except MethodOptionError:
            return None


def _check(claim: str, passed: bool, detail: Any) -> Check:
    return Check(claim=claim, passed=bool(passed), detail=detail)
