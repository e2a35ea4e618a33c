"""BENCHMARKS.md's headline is generated: it equals what the results files give, reads only results of the
current methods revision, and picks per set the run with the most cases."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

from cacheblend_rag.blend.methods import METHODS_REVISION
from cacheblend_rag.eval.headline import DEFAULT_LABEL, FIXED_LABEL, render_headline
from cacheblend_rag.eval.records import load_results, save_results
from cacheblend_rag.eval.summary import REFERENCE

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


def section(text: str, name: str) -> str:
    found = re.search(rf"<!-- BEGIN {name} -->\n(.*?)\n<!-- END {name} -->", text, re.DOTALL)
    assert found, name
    return found.group(1)


def test_the_page_shows_the_headline_its_results_give():
    assert section((ROOT / "BENCHMARKS.md").read_text(), "headline") == render_headline(RESULTS).strip()


def eval_file(folder: Path, name: str, revision: int | None, cases: int, kl: float) -> None:
    """A results file of the default and full prefill on ``cases`` cases (a published file, relabelled)."""
    results = load_results(RESULTS / "eval-multinews-128.json")
    config = replace(
        results.config,
        methods_revision=revision,
        kv_dtype="int8",
        dataset="musique-heldout",
        chunk_tokens=128,
        top_k=6,
    )
    summary = results.summarized()
    methods = {
        REFERENCE: replace(summary.methods[REFERENCE], cases=cases),
        DEFAULT_LABEL: replace(summary.methods[DEFAULT_LABEL], cases=cases, kl_first_token=kl),
    }
    save_results(replace(results, config=config, summary=replace(summary, methods=methods)), folder / name)


def test_only_current_results_count_and_the_largest_run_wins(tmp_path):
    assert "No bench results yet" in render_headline(tmp_path)
    assert "No eval results of the current methods revision" in render_headline(tmp_path)
    eval_file(tmp_path, "eval-old.json", None, 90, 0.5)
    assert "musique-heldout" not in render_headline(tmp_path)
    eval_file(tmp_path, "eval-small.json", METHODS_REVISION, 30, 0.25)
    eval_file(tmp_path, "eval-large.json", METHODS_REVISION, 90, 0.125)
    rows = [line for line in render_headline(tmp_path).splitlines() if "musique-heldout" in line]
    assert len(rows) == 1 and "| 90 |" in rows[0] and "0.125" in rows[0] and "eval-large.json" in rows[0]


def test_bench_rows_come_from_the_bench_file(tmp_path):
    shutil.copy(RESULTS / "bench.json", tmp_path / "bench.json")
    bench = json.loads((tmp_path / "bench.json").read_text())
    point = next(
        p for p in bench["sections"]["ttft"]["points"] if (p["num_chunks"], p["chunk_tokens"]) == (6, 512)
    )
    ratio = point["ttft_s"]["full_prefill"] / point["ttft_s"]["cacheblend_ram"]
    text = render_headline(tmp_path)
    assert f"| {ratio:.2f}× (" in text and "GPU TTFT" not in text


def test_a_fixed_ratio_run_counts_as_the_default_only_where_every_case_chose_it(tmp_path):
    # 512-token chunks: every case's chunks are long, so the default computed what cacheblend@0.15 did
    shutil.copy(RESULTS / "eval-musique-heldout-512-budget.json", tmp_path / "eval-long.json")
    rows = [line for line in render_headline(tmp_path).splitlines() if "musique-heldout" in line]
    assert len(rows) == 1 and f"`eval-long.json` (`{FIXED_LABEL}`)" in rows[0]
    # the same run with one case's chunks cut short: its fixed-ratio row is no longer the default's
    results = load_results(tmp_path / "eval-long.json")
    first = results.cases[0]
    short = [replace(chunk, tokens=100) for chunk in first.retrieved]
    save_results(
        replace(results, cases=[replace(first, retrieved=short), *results.cases[1:]]),
        tmp_path / "eval-long.json",
    )
    assert "musique-heldout" not in render_headline(tmp_path)
