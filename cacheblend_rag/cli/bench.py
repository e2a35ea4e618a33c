"""``cacheblend-rag bench``: TTFT, prefill, store, deviation, ingest, throughput and serving, side by
side."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from ..errors import CacheBlendError
from .eval import parse_list, settings_prefix
from .output import print_error, shown
from .progress import ProgressReporter

err_console = Console(stderr=True)


def bench_command(
    quick: Annotated[
        bool,
        typer.Option("--quick", help="Tiny sizes, one run each: checks that everything works (minutes)."),
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", help="Folder for results/bench.json and the plots (default docs, quick: bench-tmp)."
        ),
    ] = None,
    markdown: Annotated[
        Path | None,
        typer.Option(
            "--markdown", help="File whose bench section is rewritten (default BENCHMARKS.md; quick: OUT/)."
        ),
    ] = None,
    only: Annotated[
        str | None,
        typer.Option(
            "--only",
            help="Comma-separated sections (ttft, prefill, store, deviation, ingest, throughput, round, "
            "serve; codec, and vllm, which needs the \\[vllm] extra, run only when named); the others are "
            "kept from OUT's results.",
        ),
    ] = None,
    repeats: Annotated[
        int | None, typer.Option(min=1, help="Runs per timing (median kept; default 3).")
    ] = None,
    deviation_prompts: Annotated[
        int | None, typer.Option("--deviation-prompts", min=1, help="Real prompts for the deviation section.")
    ] = None,
    round_fidelity_cases: Annotated[
        int | None,
        typer.Option(
            "--round-fidelity-cases",
            min=0,
            help="Held-out MuSiQue rounds of 8 agents for the round section's fidelity (default 20).",
        ),
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="Model name or local HF folder.")] = None,
    kv_dir: Annotated[
        Path | None,
        typer.Option("--kv-dir", help="Chunk KV of the real prompts, kept across runs (default: eval's)."),
    ] = None,
) -> None:
    """Benchmark our engine against full prefill, transformers and the other PIC methods in one run."""
    from ..eval.bench import RESULTS_NAME, SECTIONS, BenchConfig, load_previous, render_bench, run_bench
    from ..eval.bench.plots import PLOT_NAMES, plot_deviation, plot_ttft_sweeps
    from ..eval.bench.results import save_results
    from ..eval.headline import HEADLINE_SECTION, render_headline
    from ..eval.markdown import update_markdown

    out = out or Path("bench-tmp" if quick else "docs")
    markdown = markdown or (out / "BENCHMARKS.md" if quick else Path("BENCHMARKS.md"))
    sections = tuple(parse_list(only, str, "--only")) if only else SECTIONS
    overrides = {"sections": sections, "model": model, "kv_dir": kv_dir}
    if repeats is not None:
        overrides["repeats"] = repeats
    if deviation_prompts is not None:
        overrides["deviation_prompts"] = deviation_prompts
    if round_fidelity_cases is not None:
        overrides["round_fidelity_cases"] = round_fidelity_cases
    results_path = out / "results" / RESULTS_NAME
    command = shlex.join(
        [
            *settings_prefix(),
            "cacheblend-rag",
            "bench",
            *(["--quick"] if quick else []),
            *(["--out", str(out)] if out != Path("docs") else []),
            *(["--only", only] if only else []),
            *(["--repeats", str(repeats)] if repeats is not None else []),
            *(["--deviation-prompts", str(deviation_prompts)] if deviation_prompts is not None else []),
            *(
                ["--round-fidelity-cases", str(round_fidelity_cases)]
                if round_fidelity_cases is not None
                else []
            ),
            *(["--model", model] if model else []),
        ]
    )
    try:
        config = BenchConfig.quick_config(**overrides) if quick else BenchConfig(**overrides)
        previous = load_previous(results_path, quick)

        with ProgressReporter(err_console) as progress:

            def on_section(name: str, state: str) -> None:
                # a section reports no count: its line says it runs, every so often, until it is done
                stage = f"bench section {name}"
                if state == "start":
                    progress.update(stage, 0)
                else:
                    progress.finish(stage)

            results = run_bench(config, previous=previous, command=command, on_section=on_section)
    except (CacheBlendError, ValueError) as exc:
        print_error(err_console, exc)
        raise typer.Exit(1) from exc
    save_results(results, results_path)
    plots = {}
    for name, plot in (("ttft", plot_ttft_sweeps), ("deviation", plot_deviation)):
        path = out / PLOT_NAMES[name]
        if name in config.sections:
            plots[name] = plot(results, path)
        elif name in results["sections"] and path.exists():
            # drawn by the run that measured it (`--only vllm` runs where matplotlib is not installed)
            plots[name] = path
    update_markdown(markdown, "bench", render_bench(results, markdown, plots))
    update_markdown(markdown, HEADLINE_SECTION, render_headline(results_path.parent))
    err_console.print(f"results: {shown(results_path)}; report: {shown(markdown)}")
