"""The per-request budget against fixed ratios: fidelity against compute on the same cases.

    .venv/bin/python tools/budget_pareto.py RESULTS.json [RESULTS.json ...] [--markdown BENCHMARKS.md]

Reads ``eval`` results files of one data set and chunk size (e.g. the plain held-out run and a run of the
budget variants on its first cases), keeps the cases every file holds, and prints one row per method:
mean share of cached tokens recomputed (with its spread over cases), compute fraction, first-token KL,
first-token agreement and agreement F1, all against full prefill. Each per-request budget row
(``budget=auto`` or ``budget=margin``) is set beside the fixed ratios at the same mean compute fraction
(linear between the two fixed rows around it): the budget dominates there when its KL is lower and its
agreement F1 higher; its first-token agreement is set beside theirs too. ``--markdown`` writes the table
into that file's section ``pareto-<data>-<chunk tokens>``. Reads JSON only; no model runs.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path

from cacheblend_rag.blend import CacheBlend, FixedBudget, Reuse, reuse_of
from cacheblend_rag.blend.spec import MethodSpec
from cacheblend_rag.eval.markdown import fmt, table, update_markdown
from cacheblend_rag.eval.records import EvalResults, MethodRecord, RunConfig, load_results
from cacheblend_rag.eval.summary import label_spec

METRICS = (
    "chunk_recompute_ratio",
    "compute_fraction",
    "kl_first_token",
    "first_token_agreement",
    "agreement_f1",
)


def _common(results: list[EvalResults]) -> tuple[list[int], dict[str, dict[int, MethodRecord]]]:
    """The case ids every file holds, and every method's records by case id."""
    ids = set.intersection(*({c.id for c in r.cases} for r in results))
    methods: dict[str, dict[int, MethodRecord]] = {}
    for result in results:
        for case in result.cases:
            if case.id in ids:
                for label, record in case.methods.items():
                    methods.setdefault(label, {})[case.id] = record
    return sorted(ids), methods


def _row(records: list[MethodRecord]) -> dict[str, float]:
    """The means of :data:`METRICS` over the records, and the spread of the share recomputed."""
    columns = {
        "chunk_recompute_ratio": [r.chunk_recompute_ratio for r in records],
        "compute_fraction": [r.compute_fraction for r in records],
        "kl_first_token": [r.kl_first_token for r in records],
        "first_token_agreement": [r.first_token_agreement for r in records],
        "agreement_f1": [r.agreement_f1 for r in records],
    }
    row = {m: statistics.fmean(float(v) for v in columns[m]) for m in METRICS}
    row["ratio_spread"] = statistics.pstdev(float(v) for v in columns["chunk_recompute_ratio"])
    return row


def fixed_at(fixed: list[dict[str, float]], compute: float, metric: str) -> float | None:
    """The fixed ratios' ``metric`` at ``compute`` (linear between the neighbouring rows), if inside."""
    for low, high in itertools.pairwise(fixed):
        if low["compute_fraction"] <= compute <= high["compute_fraction"]:
            span = high["compute_fraction"] - low["compute_fraction"]
            t = (compute - low["compute_fraction"]) / span if span else 0.0
            return low[metric] + t * (high[metric] - low[metric])
    return None


def _is_budget(spec: MethodSpec) -> bool:
    """Whether a method spec names a per-request budget (cacheblend's budget=auto, margin, ...)."""
    method = spec.build()
    return isinstance(method, CacheBlend) and not isinstance(method.budget, FixedBudget)


def _codec(config: RunConfig) -> str:
    return ",".join(config.codecs)


def render(paths: list[Path], markdown: Path | None = None) -> str:
    results = [load_results(p) for p in paths]
    codecs = {_codec(r.config) for r in results}
    config = results[0].config
    ids, methods = _common(results)
    # the columns of methods that reuse chunk KV as they are labelled (not a variant's none: or int8:)
    specs = {label: spec for label in methods if (spec := label_spec(label)) is not None}
    rows = {
        label: _row([by_case[i] for i in ids])
        for label, by_case in methods.items()
        if all(i in by_case for i in ids) and label in specs and reuse_of(specs[label]) is Reuse.CHUNKS
    }
    # the fixed curve: the columns that set a recompute ratio and no per-request budget
    fixed = sorted(
        (r for label, r in rows.items() if specs[label].ratio is not None and not _is_budget(specs[label])),
        key=lambda r: r["compute_fraction"],
    )
    body = []
    for label, r in sorted(rows.items(), key=lambda item: item[1]["compute_fraction"]):
        kl_fixed = f1_fixed = agreement_fixed = verdict = None
        if _is_budget(specs[label]):
            kl_fixed = fixed_at(fixed, r["compute_fraction"], "kl_first_token")
            f1_fixed = fixed_at(fixed, r["compute_fraction"], "agreement_f1")
            agreement_fixed = fixed_at(fixed, r["compute_fraction"], "first_token_agreement")
            if kl_fixed is not None and f1_fixed is not None:
                better = r["kl_first_token"] < kl_fixed and r["agreement_f1"] > f1_fixed
                verdict = "dominates" if better else "does not dominate"
        body.append(
            [
                f"`{label}`",
                f"{fmt(r['chunk_recompute_ratio'], 3)} ± {fmt(r['ratio_spread'], 3)}",
                fmt(r["compute_fraction"], 3),
                fmt(r["kl_first_token"]),
                fmt(r["first_token_agreement"], 3),
                fmt(r["agreement_f1"]),
                fmt(kl_fixed) if kl_fixed is not None else "-",
                fmt(f1_fixed) if f1_fixed is not None else "-",
                fmt(agreement_fixed, 3) if agreement_fixed is not None else "-",
                verdict or "-",
            ]
        )
    header = [
        "method",
        "cached tokens recomputed (mean ± sd)",
        "compute fraction",
        "first-token KL",
        "first-token agreement",
        "agreement F1",
        "fixed r at equal compute: KL",
        "fixed r: agreement F1",
        "fixed r: first-token agreement",
        "budget",
    ]
    command = "python tools/budget_pareto.py " + " ".join(str(p) for p in paths)
    if markdown is not None:
        command += f" --markdown {markdown}"
    lines = [
        f"#### Per-request budget vs fixed ratios: {config.dataset}, {len(ids)} cases, chunks of <= "
        f"{config.chunk_tokens} tokens, top-k {config.top_k}",
        "",
        "```bash",
        *(c for r in results for c in dict.fromkeys(r.commands)),
        command,
        "```",
        "",
        "Fidelity against full prefill on the cases every results file holds (means over cases; these do",
        "not depend on the machine's load). `budget=auto` recomputes the fewest cached tokens whose",
        "question-attention contribution covers `target` of it, between `min_ratio` (2 % unless named) and",
        "`ratio` of them; `budget=margin` recomputes `ratio` of them when full reuse's next token leads its",
        "runner-up by less than `confident`, else `min_ratio` of them.",
        f"Chunk KV codec: {', '.join(sorted(codecs))}"
        + (" (the files differ: rows from different files are not comparable)" if len(codecs) > 1 else "."),
        "",
        table(header, body),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    text = render(args.results, args.markdown)
    print(text)
    if args.markdown is not None:
        config = load_results(args.results[0]).config
        update_markdown(args.markdown, f"pareto-{config.dataset}-{config.chunk_tokens}", text)


if __name__ == "__main__":
    main()
