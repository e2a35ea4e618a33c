"""The ``serve`` bench section (eval/bench/serve.py) as a smoke test: quick sizes, a couple of requests per
level and method through a real server. Timings are not checked; the structure and the reuse are."""

from __future__ import annotations

import pytest

from cacheblend_rag.eval.bench import BenchConfig, ServeLoadConfig, render_bench, run_bench

pytestmark = pytest.mark.slow


def test_serve_section_runs_and_renders(model, tmp_path):
    config = BenchConfig.quick_config(sections=("serve",), work_dir=tmp_path / "work")
    results = run_bench(config, model=model)
    serve = results["sections"]["serve"]
    assert serve["levels"] == [1, 2] and serve["max_batch"] == 2 and serve["prompts"] >= 1
    for method in ("full_recompute", "cacheblend"):
        for level in ("1", "2"):
            row = serve["methods"][method][level]
            assert row["requests"] == int(level) and row["requests_per_s"] > 0
            assert 0 < row["ttft_p50_s"] <= row["ttft_p95_s"] and row["server_ttft_p50_s"] > 0
            assert all(r["answer"] and r["tokens"] == 2 for r in row["requests_detail"])
    assert serve["methods"]["cacheblend"]["2"]["cached_tokens_mean"] > 0  # the chunks were recognised
    assert serve["methods"]["full_recompute"]["2"]["cached_tokens_mean"] == 0
    assert set(serve["speedup_cacheblend_vs_full"]) == {"1", "2"}
    assert (
        serve["scheduler"]["completed"] >= 2 * (serve["prompts"] + 3) and serve["scheduler"]["cancelled"] == 0
    )

    markdown = render_bench(results, tmp_path / "BENCHMARKS.md", {})
    assert "through `cacheblend-rag serve`" in markdown
    assert "| 2 | `cacheblend` | 2 |" in markdown


def test_config_is_checked():
    with pytest.raises(ValueError, match="concurrency levels"):
        ServeLoadConfig(levels=(0,))
    with pytest.raises(ValueError, match="rounds"):
        ServeLoadConfig(rounds=0)
