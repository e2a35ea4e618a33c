"""Choose ``budget=margin``'s options on a development run: simulate the step rule from fixed ratios.

    .venv/bin/python tools/margin_budget.py RESULTS.json [--confident 0.05,0.1,...] [--lows 0,0.05]
        [--highs 0.3,0.5] [--markdown FILE]

``RESULTS.json`` is a ``tune`` or ``eval`` results file with ``full_reuse`` and ``cacheblend@R`` columns at
several fixed ratios R. ``cacheblend@ratio=HI,budget=margin,min_ratio=LO,confident=C`` recomputes, per
request, exactly what ``cacheblend@HI`` does when full reuse's first token leads its runner-up by less than
C, else what ``cacheblend@LO`` does (``LO`` = 0 is full reuse's selection); so each case's outcome under the
rule is read from those columns, using full reuse's ``first_token_margin``. Prints, per rule, the mean share
recomputed and compute fraction, first-token KL, first-token agreement and agreement F1, beside the fixed
ratios. Reads JSON only; no model runs (the held-out check runs the real method: BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

# the same metrics and interpolation as the budget=auto table
from budget_pareto import METRICS, fixed_at

from cacheblend_rag.blend import CacheBlend
from cacheblend_rag.eval.markdown import fmt, table, update_markdown
from cacheblend_rag.eval.summary import label_spec


def fixed_columns(case: dict) -> dict[float, dict]:
    """The case's records by fixed ratio (full reuse as 0): cacheblend's columns that set the ratio alone."""
    out = {0.0: case["methods"]["full_reuse"]}
    for label, record in case["methods"].items():
        spec = label_spec(label)
        if (
            spec is not None
            and spec.method_class is CacheBlend
            and len(spec.options) == 1
            and spec.ratio is not None
        ):
            out[float(spec.ratio)] = record
    return out


def mean_row(records: list[dict]) -> dict[str, float]:
    return {m: statistics.fmean(float(r[m]) for r in records) for m in METRICS}


def simulate(
    by_case: list[dict[float, dict]], low: float, high: float, confident: float
) -> tuple[dict[str, float], float]:
    """The rule's mean metrics over the cases (each its :func:`fixed_columns`), and the share of cases
    that got ``high``."""
    picked, unsure = [], 0
    for columns in by_case:
        could_flip = columns[0.0]["first_token_margin"] < confident
        unsure += could_flip
        picked.append(columns[high if could_flip else low])
    return mean_row(picked), unsure / len(by_case)


def render(
    path: Path,
    confidents: list[float],
    markdown: Path | None,
    lows: list[float] | None = None,
    highs: list[float] | None = None,
) -> str:
    results = json.loads(path.read_text())
    by_case = [fixed_columns(c) for c in results["cases"] if "full_reuse" in c["methods"]]
    ratios = sorted(set.intersection(*(set(columns) for columns in by_case)))
    rows, fixed = [], []
    for r in ratios:
        row = mean_row([columns[r] for columns in by_case])
        fixed.append(row)
        rows.append([f"fixed r = {r:g}", "-", *(fmt(row[m], 3) for m in METRICS), "-", "-", "-"])
    for low, high in itertools.combinations(ratios, 2):
        if (lows is not None and low not in lows) or (highs is not None and high not in highs):
            continue
        for confident in confidents:
            row, unsure = simulate(by_case, low, high, confident)
            label = f"margin: {high:g} below {confident:g}, else {low:g}"
            at = [fixed_at(fixed, row["compute_fraction"], m) for m in METRICS[2:]]
            rows.append(
                [
                    label,
                    fmt(unsure, 2),
                    *(fmt(row[m], 3) for m in METRICS),
                    *(fmt(x, 3) if x is not None else "-" for x in at),
                ]
            )
    header = [
        "rule",
        "share given ratio",
        "recomputed",
        "compute fraction",
        "first-token KL",
        "first-token agreement",
        "agreement F1",
        "fixed r at equal compute: KL",
        "fixed r: first-token agreement",
        "fixed r: agreement F1",
    ]
    config = results["config"]
    command = [str(path), "--confident", ",".join(f"{c:g}" for c in confidents)]
    command += ["--lows", ",".join(f"{x:g}" for x in lows)] if lows is not None else []
    command += ["--highs", ",".join(f"{x:g}" for x in highs)] if highs is not None else []
    command += ["--markdown", str(markdown)] if markdown is not None else []
    margins = sorted(columns[0.0]["first_token_margin"] for columns in by_case)
    text = "\n".join(
        [
            f"#### budget=margin simulated: {config.get('dataset', '?')}, {len(by_case)} cases, chunks of <= "
            f"{config.get('chunk_tokens')} tokens, top-k {config.get('top_k')}",
            "",
            "```bash",
            *dict.fromkeys(results.get("commands") or []),
            "python tools/margin_budget.py " + " ".join(command),
            "```",
            "",
            f"Full reuse's first-token lead over its runner-up: median {statistics.median(margins):.3f}, "
            f"quartiles {margins[len(margins) // 4]:.3f} / {margins[(3 * len(margins)) // 4]:.3f}.",
            "",
            table(header, rows),
        ]
    )
    if markdown is not None:
        update_markdown(
            markdown, f"margin-{config.get('dataset', 'data')}-{config.get('chunk_tokens')}", text
        )
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("--confident", default="0.05,0.1,0.2,0.3")
    parser.add_argument("--lows", default=None, help="min_ratio values to show (default: every ratio)")
    parser.add_argument("--highs", default=None, help="ratio values to show (default: every ratio)")
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()

    def floats(text: str | None) -> list[float] | None:
        return None if text is None else [float(x) for x in text.split(",")]

    print(render(args.results, floats(args.confident), args.markdown, floats(args.lows), floats(args.highs)))


if __name__ == "__main__":
    main()
