"""`cacheblend-rag bench --quick`: every section runs and the JSON and markdown have their structure.
Timings are not checked (the quick sizes are too small to mean anything)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from cacheblend_rag.cli import app
from cacheblend_rag.eval.bench import (
    ALL_SECTIONS,
    QUERY_METHODS,
    SECTIONS,
    THROUGHPUT_METHODS,
    TTFT_COLUMNS,
    render_bench,
)
from cacheblend_rag.eval.bench.report import RENDERERS
from cacheblend_rag.eval.markdown import update_markdown

REPO = Path(__file__).parents[2]


def test_update_markdown_replaces_only_its_section(tmp_path):
    path = tmp_path / "B.md"
    update_markdown(path, "a", "first")
    update_markdown(path, "b", "other")
    update_markdown(path, "a", "second $1 \\1")  # replacement text is taken literally
    text = path.read_text()
    assert text.startswith("# Benchmarks")
    assert "<!-- BEGIN a -->\nsecond $1 \\1\n<!-- END a -->" in text and "first" not in text
    assert text.index("BEGIN a") < text.index("BEGIN b") and "other" in text


def test_the_only_option_names_every_section():
    result = CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.replace("│", " ").split())
    only = text[text.index("--only") : text.index("--repeats")]
    assert [name for name in ALL_SECTIONS if not re.search(rf"\b{name}\b", only)] == []


def test_bench_quick_runs_every_section(tmp_path):
    out, kv = tmp_path / "out", tmp_path / "kv"
    result = CliRunner().invoke(app, ["bench", "--quick", "--out", str(out), "--kv-dir", str(kv)])
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results" / "bench.json").read_text())
    assert results["format"] == "cacheblend-rag-bench/1" and results["config"]["quick"] is True
    assert {"cpu", "cores", "threads", "torch"} <= set(results["machine"])
    sections = results["sections"]
    assert set(sections) == set(SECTIONS)
    assert all(s["seconds"] > 0 and "load_average" in s for s in sections.values())

    ttft = sections["ttft"]
    assert {(p["num_chunks"], p["chunk_tokens"]) for p in ttft["points"]} == {(2, 64), (3, 64), (3, 32)}
    for point in ttft["points"]:
        assert set(point["ttft_s"]) == set(TTFT_COLUMNS) and min(point["ttft_s"].values()) > 0
        assert point["compute_fraction"]["full_prefill"] == 1.0
        assert point["compute_fraction"]["full_reuse"] < point["compute_fraction"]["cacheblend_ram"] < 1.0
    assert (ttft["headline"]["num_chunks"], ttft["headline"]["chunk_tokens"]) == (3, 64)
    assert [type(c["passed"]) for c in ttft["checks"]] == [bool] * 6

    prefill = sections["prefill"]
    assert prefill["tokens"] == 256 and prefill["max_abs_logit_diff"] < 1e-3
    assert sections["store"]["storage_bytes"]["float16"]["bytes_per_token"] == 23040
    assert set(sections["store"]["loading"]["load_all_layers_s"]) == {"ram", "disk_warm", "disk_cold"}

    deviation = sections["deviation"]
    assert deviation["prompts"] == 2
    assert set(deviation["summary"]) == {
        "cacheblend@0",
        "cacheblend@0.15",
        "epic@16",
        f"epic@{deviation['epic_matched_k']}",
        "full_reuse",
    }
    assert all(len(p["methods"]["full_reuse"]["attention_per_layer"]) == 30 for p in deviation["per_prompt"])

    ingest = sections["ingest"]
    assert ingest["files"] == 1 and ingest["chunks"] > 0 and ingest["tokens_per_s"] > 0
    assert set(ingest["query_ttft_median_s"]) == set(QUERY_METHODS)

    throughput = sections["throughput"]
    sequential, scheduled = throughput["runners"]["sequential"], throughput["runners"]["scheduler"]
    assert set(sequential) == set(scheduled) == set(THROUGHPUT_METHODS)
    assert all(r["requests"] == 2 and r["ttft_p50_s"] <= r["ttft_p95_s"] for r in sequential.values())
    assert all(set(levels) == {"1", "2"} for levels in scheduled.values())
    # greedy answers through the scheduler equal the one-at-a-time ones
    same = [c for c in throughput["checks"] if "one-at-a-time" in c["claim"]]
    assert len(same) == 3 and all(c["passed"] for c in same)

    rounds = sections["round"]
    assert rounds["levels"] == [1, 2] and set(rounds["timing"]["full_prefill"]) == {"1"}
    assert rounds["timing"]["round"]["2"]["round_requests"] == 2  # two agents shared one blend
    assert rounds["timing"]["per_request"]["2"]["round_requests"] == 0
    assert rounds["timing"]["round_own_order"]["2"]["round_requests"] == 2
    assert rounds["fidelity"]["cases"] == 1 and 0 <= rounds["fidelity"]["agree_round"] <= 1

    markdown = (out / "BENCHMARKS.md").read_text()
    assert "<!-- BEGIN bench -->" in markdown and "<!-- END bench -->" in markdown
    assert "<!-- BEGIN headline -->" in markdown and "CPU TTFT, full prefill / default" in markdown
    for title in (
        "Time to first token",
        "Full prefill: ours vs transformers",
        "Attention deviation vs recompute ratio",
        "KV store: loading and storage",
        "Ingest and query on the sample corpus",
        "Throughput",
        "Rounds: N agents over the same chunks",
    ):
        assert title in markdown
    assert "cacheblend-rag bench --quick" in markdown
    assert (out / "ttft_vs_chunks.png").stat().st_size > 10_000
    assert "](attention_deviation_vs_ratio.png)" in markdown

    # a partial rerun replaces its section and keeps the others
    again = CliRunner().invoke(
        app, ["bench", "--quick", "--out", str(out), "--kv-dir", str(kv), "--only", "prefill"]
    )
    assert again.exit_code == 0, again.output
    rerun = json.loads((out / "results" / "bench.json").read_text())
    assert rerun["sections"]["ttft"] == sections["ttft"]
    assert (
        rerun["sections"]["prefill"]["machine"]["timestamp"] != ""
        and "--only prefill" in rerun["commands"]["prefill"]
    )
    assert rerun["sections"]["prefill"]["samples"] != prefill["samples"]

    bad = CliRunner().invoke(app, ["bench", "--quick", "--out", str(out), "--only", "nope"])
    assert bad.exit_code == 1 and "unknown bench section" in bad.output


def test_bench_codec_section_compares_codecs(tmp_path, monkeypatch):
    monkeypatch.delenv("CACHEBLEND_KV_REMOTE", raising=False)
    out, kv = tmp_path / "out", tmp_path / "kv"
    args = ["bench", "--quick", "--only", "codec", "--out", str(out), "--kv-dir", str(kv)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    section = json.loads((out / "results" / "bench.json").read_text())["sections"]["codec"]
    assert section["codecs"] == ["float16", "int8", "int4"]
    for where in section["bytes_per_token"].values():
        assert where["float16"]["vs_float16"] == 1.0
        assert where["int4"]["file_bytes"] < where["int8"]["file_bytes"] < where["float16"]["file_bytes"]
    assert all(section["ttft"]["median_s"][c]["disk"] > 0 for c in section["codecs"])
    assert all(section["ingest"][c]["tokens_per_s"] > 0 for c in section["codecs"])
    assert "no remote tier configured" in section["remote"]["skipped"]
    assert "Chunk KV codecs" in (out / "BENCHMARKS.md").read_text()


def test_round_growth_check_allows_only_the_agents_own_tokens_share():
    from cacheblend_rag.eval.bench.round import RoundFidelity, RoundTiming, round_checks

    def timing(t8, t16):
        row = {"round_recomputed_tokens": 460, "round_requests": 8, "requests_per_s": 1.0}
        row |= {"peak_kv_bytes": 0, "samples_all_first_tokens_s": []}
        return {
            "round": {
                "8": RoundTiming(**row, all_first_tokens_s=t8, agent_computed_tokens=340),
                "16": RoundTiming(**row, all_first_tokens_s=t16, agent_computed_tokens=680),
            },
            "per_request": {},
            "full_prefill": {},
        }

    fidelity = RoundFidelity(cases=0)
    # 800 -> 1,140 computed tokens: +42.5 % (printed as 43 %)
    (within,) = round_checks(timing(5.0, 7.0), fidelity)
    (beyond,) = round_checks(timing(5.0, 7.5), fidelity)
    assert within.passed and abs(within.value - 0.4) < 1e-9
    assert not beyond.passed and "+43% computed tokens" in beyond.claim


def _through_records(results: dict) -> dict:
    """``results`` with every section read into its record and written back."""
    sections = {
        name: RENDERERS[name].result.from_dict(s).to_dict() for name, s in results["sections"].items()
    }
    return {**results, "sections": sections}


def test_the_committed_bench_results_render_the_same_through_their_records():
    """docs/results/bench.json read into the sections' records and written back is the same file (keys in
    the same order), and renders the bench block of BENCHMARKS.md as committed."""
    results = json.loads((REPO / "docs" / "results" / "bench.json").read_text())
    rewritten = _through_records(results)
    assert json.dumps(rewritten) == json.dumps(results)
    markdown = REPO / "BENCHMARKS.md"
    plots = {
        "ttft": REPO / "docs" / "ttft_vs_chunks.png",
        "deviation": REPO / "docs" / "attention_deviation_vs_ratio.png",
    }
    page = render_bench(rewritten, markdown, plots)
    assert page == render_bench(results, markdown, plots)
    committed = re.search(r"<!-- BEGIN bench -->\n(.*?)\n<!-- END bench -->", markdown.read_text(), re.DOTALL)
    assert committed is not None and page == committed.group(1)


def test_older_bench_results_without_the_newer_keys_still_render():
    """Keys older results lack (vLLM's sizes, agreement, processor and memory; the round's computed
    tokens; batched fusion) are left out when written back, and the rest renders as before."""
    results = json.loads((REPO / "docs" / "results" / "bench.json").read_text())
    sections = results["sections"]
    for key in ("processor", "by_chunks", "first_token_agreement", "worker_memory"):
        del sections["vllm"][key]
    for rows in sections["round"]["timing"].values():
        for row in rows.values():
            del row["agent_computed_tokens"], row["round_recomputed_tokens"]
    del sections["throughput"]["batched_fusion"]
    assert _through_records(results) == results
    page = render_bench(results, REPO / "BENCHMARKS.md", {})
    assert "vLLM worker resident memory" not in page and "Processor:" not in page
    assert "| (c) round | 8 |" in page and " | - | - |" in page
    assert "Fusing an admission group" not in page and "Throughput: concurrent requests" in page
