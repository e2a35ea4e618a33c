"""The eval harness on tiny real cases: every method, the metrics' invariants, resuming, the CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cacheblend_rag.blend.spec import parse_method
from cacheblend_rag.cli import app
from cacheblend_rag.config import DEFAULT_CHUNK_TOKENS, DEFAULT_METHOD, DEFAULT_TOP_K
from cacheblend_rag.errors import EvalDataError
from cacheblend_rag.eval.datasets import load_dataset
from cacheblend_rag.eval.harness import EvalConfig, run_eval
from cacheblend_rag.eval.headline import DEFAULT_LABEL
from cacheblend_rag.eval.metrics import normalize_answer
from cacheblend_rag.eval.records import load_results
from cacheblend_rag.eval.report import render_eval
from cacheblend_rag.eval.summary import summarize
from cacheblend_rag.eval.tune import render_tune
from cacheblend_rag.eval.variants import method_specs
from cacheblend_rag.store.codec import get_codec

METHODS = ("full_recompute", "prefix_cache", "full_reuse", "cacheblend", "epic", DEFAULT_METHOD)
RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
LABELS = {"full_recompute", "prefix_cache", "full_reuse", "cacheblend@0", "cacheblend@0.15", "epic"}
LABELS |= {DEFAULT_LABEL}


def tiny_data(tmp_path, name: str, cases: int, contexts: int, chars: int):
    """Real cases of a bundled set with fewer, shorter contexts (keeps each prompt to ~150 tokens)."""
    items = []
    for case in load_dataset(name).cases[:cases]:
        ctxs = [{"title": c.title, "text": c.text[:chars]} for c in case.contexts[:contexts]]
        items.append(
            {"id": case.case_id, "question": case.question, "answers": list(case.answers), "ctxs": ctxs}
        )
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(items))
    return path


def test_method_labels():
    specs = method_specs(["cacheblend", "epic", "epic@32"], [0.15, 0])
    assert [s.label for s in specs] == [
        "full_recompute",
        "cacheblend@0.15",
        "cacheblend@0",
        "epic",
        "epic@32",
    ]
    assert specs[1].build().ratio == 0.15 and specs[4].build().k == 32
    with pytest.raises(ValueError, match="unknown method"):
        parse_method("nope")
    with pytest.raises(ValueError, match="ratio"):
        parse_method("cacheblend@1.5")
    with pytest.raises(ValueError, match="no @option"):
        parse_method("full_reuse@3")


@pytest.fixture(scope="module")
def qa_run(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("eval")
    config = EvalConfig(
        data=str(tiny_data(tmp, "musique", cases=2, contexts=3, chars=350)),
        methods=METHODS,
        ratios=(0.0, 0.15),
        top_k=3,
        chunk_tokens=48,
        max_new_tokens=4,
        kv_dir=tmp / "kv",
        json_path=tmp / "results.json",
    )
    return config, run_eval(config, model=model)


def test_eval_scores_every_method_against_the_reference(qa_run):
    config, results = qa_run
    assert len(results.cases) == 2
    for case in results.cases:
        methods = case.methods
        assert set(methods) == LABELS
        assert len(case.retrieved) == 3 and all(r.tokens <= 48 for r in case.retrieved)
        scores = [r.score for r in case.retrieved]
        assert scores == sorted(scores, reverse=True)
        reference = methods["full_recompute"]
        assert reference.agreement_f1 == 1.0 or not normalize_answer(reference.answer)
        assert reference.first_token_agreement is True
        assert reference.kl_first_token == pytest.approx(0.0, abs=1e-6)
        assert reference.chunk_recompute_ratio == 1.0
        assert methods["full_reuse"].chunk_recompute_ratio == 0.0
        assert 0.1 <= methods["cacheblend@0.15"].chunk_recompute_ratio <= 0.25
        # prefix_cache reuses the first chunk only
        first = case.retrieved[0].tokens / case.cached_tokens
        assert methods["prefix_cache"].chunk_recompute_ratio == pytest.approx(1 - first)
        # prefix reuse is exact up to the stored codec's error: with float16 KV the same first-token
        # distribution as full prefill; with quantized KV (the int8 default) within the codec's error
        lossless = not get_codec(results.config.kv_dtype).quantized
        assert methods["prefix_cache"].kl_first_token < (1e-4 if lossless else 1e-3)
        for label, m in methods.items():
            assert m.ttft_s > 0 and m.nll_gold > 0, label
            assert 0 <= m.gold <= 1 and 0 <= m.agreement_f1 <= 1
            assert m.kl_first_token >= 0
            assert 0.0 <= m.first_token_margin <= 1.0, label
        # prefix reuse is exact up to the codec: its first token is as sure as full prefill's
        assert reference.first_token_margin == pytest.approx(
            methods["prefix_cache"].first_token_margin, abs=5e-3
        )
    summary = results.summarized()
    assert summary.cases == 2 and set(summary.methods) == LABELS
    # first-token agreement split at the default margin: every case decisive or a near-tie, per method
    assert summary.decisive_margin == results.config.decisive_margin == 0.5
    for label, entry in summary.methods.items():
        assert entry.decisive_cases + entry.near_tie_cases == 2, label
        assert entry.decisive_agreeing + entry.near_tie_agreeing == round(2 * entry.first_token_agreement)
    margins = sorted(case.methods["full_recompute"].reference_margin for case in results.cases)
    # the same records split at another margin: between the two cases' margins, one each side
    between = summarize(results.cases, results.config.task, decisive_margin=(margins[0] + margins[1]) / 2)
    assert between.decisive_margin == (margins[0] + margins[1]) / 2
    assert {e.decisive_cases for e in between.methods.values()} == ({1} if margins[0] < margins[1] else {2})
    assert summary.methods["full_recompute"].speedup_median == 1.0
    # the default's claims are on its own column: every claim names it, and its budget held
    claims = [c.claim for c in summary.checks if not c.claim.startswith("monotone")]
    assert claims and all(DEFAULT_LABEL in claim for claim in claims)
    assert all(isinstance(c.passed, bool) for c in summary.checks)
    budget = summary.checks[0]
    assert "than its budget chose" in budget.claim and budget.passed
    assert budget.detail["budget_ratio"] == summary.methods[DEFAULT_LABEL].budget_ratio
    # the tiny cases' 48-token chunks are short: the default recomputed more than the fixed ratio
    fixed = summary.methods["cacheblend@0.15"].chunk_recompute_ratio
    assert summary.methods[DEFAULT_LABEL].budget_ratio > fixed
    on_disk = load_results(config.json_path)
    assert on_disk == results and on_disk.config.top_k == 3
    assert json.loads(config.json_path.read_text()) == results.to_dict()


def test_rerun_skips_finished_cases_and_adds_new_methods(qa_run, model):
    config, first = qa_run
    again = run_eval(config, model=model)
    assert again.cases == first.cases  # nothing recomputed: timings identical
    # the machine line keeps the first start's load (what the timings ran under); the rerun is beside it
    assert again.machine == first.machine and len(again.resumes) == 1

    extended = EvalConfig(**{**config.__dict__, "ratios": (0.0, 0.15, 0.3), "limit": 1})
    results = run_eval(extended, model=model)
    case = next(c for c in results.cases if "cacheblend@0.3" in c.methods)
    before = next(c for c in first.cases if c.id == case.id)
    assert case.methods["cacheblend@0.15"] == before.methods["cacheblend@0.15"]
    assert results.summarized().cases == 1

    with pytest.raises(EvalDataError, match="top_k"):
        run_eval(EvalConfig(**{**config.__dict__, "top_k": 2}), model=model)

    # a file from before a default changed what a label computes (no methods_revision: revision 1) is
    # not resumed: its cacheblend@0.15 columns ran without the chunk-shift correction
    older = json.loads(config.json_path.read_text())
    del older["config"]["methods_revision"]
    old_path = config.json_path.with_name("before-the-shift.json")
    old_path.write_text(json.dumps(older))
    with pytest.raises(EvalDataError, match="methods_revision"):
        run_eval(EvalConfig(**{**config.__dict__, "json_path": old_path}), model=model)


def test_first_token_margin_is_the_lead_over_the_runner_up():
    from cacheblend_rag.blend.methods import next_token_lead

    logprobs = torch.tensor([0.1, 0.6, 0.25, 0.05]).log()
    assert next_token_lead(logprobs) == pytest.approx(0.35)
    assert next_token_lead(torch.tensor([0.5, 0.5]).log()) == pytest.approx(0.0)


def test_eval_cli_summary_task_writes_json_markdown_and_plot(tmp_path):
    data = tiny_data(tmp_path, "multinews", cases=1, contexts=2, chars=400)
    out, markdown, plot = tmp_path / "news.json", tmp_path / "BENCH.md", tmp_path / "q.png"
    markdown.write_text("# Benchmarks\n\n<!-- BEGIN other -->\nkept\n<!-- END other -->\n")
    args = [
        "eval", "--data", str(data), "--methods", "full_recompute,full_reuse,cacheblend", "--ratios", "0.15",
        "--top-k", "2", "--chunk-tokens", "64", "--max-new-tokens", "6", "--json", str(out),
        "--markdown", str(markdown), "--plot", str(plot), "--kv-dir", str(tmp_path / "kv"),
        "--decisive-margin", "0.25",
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    results = load_results(out)
    assert results.config.task == "summary"
    # the margin is a value passed down: recorded with the run and its summary, and in the command
    assert results.config.decisive_margin == results.summarized().decisive_margin == 0.25
    assert "--decisive-margin 0.25" in results.commands[0]
    decisive = results.cases[0].methods["full_recompute"].reference_margin >= 0.25
    for label, entry in results.summarized().methods.items():
        assert (entry.decisive_cases, entry.near_tie_cases) == ((1, 0) if decisive else (0, 1)), label
    words = " ".join(result.output.split())  # the table's headers wrap at the runner's width
    assert "full prefill's first token leads its runner-up by >= 0.25 nats; near-tie: the rest" in words
    case = results.cases[0]
    assert all(r.score is None for r in case.retrieved)  # summaries take chunks in document order
    blend = case.methods["cacheblend@0.15"]
    assert None not in (blend.agreement_rouge_l, blend.gold, blend.nll_gold)
    text = markdown.read_text()
    assert (
        "<!-- BEGIN other -->\nkept" in text and "<!-- BEGIN eval-multinews-64-top2 -->" in text
    )  # a non-default chunk size and top-k name its section
    assert "gold Rouge-L" in text and "cacheblend-rag eval --data" in text and "](q.png)" in text
    assert "| decisive (n) | near ties (n) |" in text and "leads the runner-up's by >= 0.25 nats" in text
    assert plot.stat().st_size > 10_000

    bad = CliRunner().invoke(app, ["eval", "--data", str(tmp_path / "missing.json")])
    assert bad.exit_code == 1 and "no data set" in bad.output


def test_eval_compares_codecs_against_float16_with_one_full_prefill_per_case(tmp_path):
    data = tiny_data(tmp_path, "musique", cases=2, contexts=2, chars=300)
    out, markdown = tmp_path / "codecs.json", tmp_path / "BENCH.md"
    args = [
        "eval", "--data", str(data), "--methods", "full_recompute,full_reuse,cacheblend", "--ratios", "0.15",
        "--kv-dtypes", "float16,int8,int4", "--limit", "2", "--top-k", "2", "--chunk-tokens", "48",
        "--max-new-tokens", "4", "--json", str(out), "--markdown", str(markdown),
        "--kv-dir", str(tmp_path / "kv"),
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    results = load_results(out)
    assert results.config.kv_dtypes == ["float16", "int8", "int4"]
    labels = set(results.summarized().methods)
    assert labels == {
        "full_recompute",
        *(f"{prefix}{m}" for prefix in ("", "int8:", "int4:") for m in ("full_reuse", "cacheblend@0.15")),
    }
    for case in results.cases:
        methods = case.methods
        assert methods["full_recompute"].kl_first_token == 0.0
        assert methods["int8:full_reuse"].kl_first_token >= 0.0
    stored = {p.name.split(".")[0] for p in (tmp_path / "kv" / "chunks").glob("??/*.safetensors")}
    assert len(stored) % 3 == 0  # every chunk once per codec, under its own key
    text = markdown.read_text()
    assert "Chunk KV codecs against float16" in text and "| int4 | `cacheblend@0.15` |" in text
    assert "<!-- BEGIN eval-musique-48-top2-codecs -->" in text  # beside, not over, the plain run's section


def test_eval_sections_differ_by_chunk_size_top_k_and_codecs():
    from cacheblend_rag.eval.report import eval_section_name

    published = load_results(RESULTS / "eval-musique-heldout-512-shift.json")

    default = {"dataset": "musique-heldout", "chunk_tokens": DEFAULT_CHUNK_TOKENS, "top_k": DEFAULT_TOP_K}

    def name(**config) -> str:
        settings = {**default, "kv_dtypes": None, **config}
        return eval_section_name(replace(published, config=replace(published.config, **settings)))

    assert name() == name(chunk_tokens=512, top_k=6) == "eval-musique-heldout"
    assert name(chunk_tokens=128) == "eval-musique-heldout-128"
    assert name(chunk_tokens=128, top_k=12) == "eval-musique-heldout-128-top12"  # not over top-k 6's
    assert name(kv_dtypes=["float16", "int8"]) == "eval-musique-heldout-codecs"


# the current results and the superseded ones kept under docs/notes/
PUBLISHED = [RESULTS, RESULTS.parent / "notes" / "results"]


def test_both_results_folders_are_read():
    assert [folder for folder in PUBLISHED if not any(folder.glob("eval-*.json"))] == []


@pytest.mark.parametrize(
    "path",
    sorted(
        p for folder in PUBLISHED for pattern in ("eval-*.json", "tune-*.json") for p in folder.glob(pattern)
    ),
)
def test_results_recorded_before_the_split_still_render(path, tmp_path):
    """Published results recorded before the split carry no first-token margin: their tables show ``-``
    for it, summarised again or as stored, rather than failing or showing zeros; those recorded since show
    the split's counts either way."""
    results = load_results(path)
    split = any(entry.decisive_cases is not None for entry in results.summarized().methods.values())
    again = replace(results, summary=summarize(results.cases, results.config.task))
    for summary in (results.summarized(), again.summarized()):
        assert split == any(entry.decisive_cases is not None for entry in summary.methods.values())
    render = render_tune if path.name.startswith("tune-") else render_eval
    for version in (results, again):
        text = render(version) if render is render_tune else render(version, tmp_path / "B.md")
        assert "| decisive (n) | near ties (n) |" in text
        assert ("| - | - |" in text) != split
