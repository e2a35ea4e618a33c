"""The project's tools and profiling scripts run, at the smallest size that goes through their whole path,
so that none rots between the rounds that use it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


def run(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_budget_pareto_sets_each_budget_beside_the_fixed_curve(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# results\n")
    done = run(
        "tools/budget_pareto.py",
        str(RESULTS / "eval-musique-heldout-128-budget.json"),
        str(RESULTS / "eval-musique-heldout-128-fixed.json"),
        "--markdown",
        str(page),
    )
    rows = [line for line in done.stdout.splitlines() if line.startswith("| `cacheblend@ratio=")]
    assert len(rows) == 6 and all("dominate" in row.split("|")[-2] for row in rows), rows
    assert "BEGIN pareto-musique-heldout-128" in page.read_text()


def test_margin_budget_simulates_the_step_rule_from_fixed_ratios():
    done = run("tools/margin_budget.py", str(RESULTS / "tune-musique-128-grid.json"), "--confident", "0.1")
    rules = [line for line in done.stdout.splitlines() if line.startswith("| margin: ")]
    assert rules and all(" below 0.1, else " in rule for rule in rules), done.stdout


def test_greedy_answers_of_a_run_compare_equal_to_themselves(tmp_path):
    out = tmp_path / "answers.json"
    run(
        "tools/greedy_answers.py",
        "--prompts",
        "1",
        "--chunk-tokens",
        "32",
        "--max-new-tokens",
        "2",
        "--out",
        str(out),
    )
    answers = json.loads(out.read_text())["answers"]
    assert [len(a) for a in answers.values()] == [1, 1]
    done = run("tools/greedy_answers.py", "--compare", str(out), str(out))
    assert "cacheblend: 1 of 1 answers identical" in done.stdout


def test_ttft_single_prints_its_samples():
    done = run(
        "tools/ttft_single.py", "--chunks", "2", "--chunk-tokens", "32", "--repeats", "2", "--threads", "1"
    )
    timing = json.loads(done.stdout)
    assert len(timing["samples_s"]) == 2 and timing["median_s"] > 0


def test_profile_fusion_profiles_and_times_each_method(tmp_path):
    common = ("--chunks", "2", "--chunk-tokens", "32", "--methods", "full_recompute", "cacheblend")
    done = run("scripts/profile_fusion.py", *common, "--rows", "3", "--trace", str(tmp_path))
    assert "=== cacheblend:" in done.stdout and (tmp_path / "cacheblend.json").is_file()
    done = run("scripts/profile_fusion.py", *common, "--time", "1")
    assert "cacheblend: median" in done.stdout


def test_profile_round_times_the_round_through_the_scheduler():
    done = run("scripts/profile_round.py", "--agents", "2", "--chunks", "2", "--chunk-tokens", "32")
    assert "Engine.fuse_group (rounds), 2 agents" in done.stdout, done.stdout
    assert "all first tokens" in done.stdout, done.stdout


def test_check_fusion_equal_saves_and_finds_a_run_equal_to_itself(tmp_path):
    saved = tmp_path / "before.pt"
    small = ("--prompts", "1", "--steps", "2", "--fusion", "static")
    run("tools/check_fusion_equal.py", "--save", str(saved), *small)
    done = run("tools/check_fusion_equal.py", "--compare", str(saved), *small)
    assert done.stdout.count("-> ok") == 2, done.stdout
