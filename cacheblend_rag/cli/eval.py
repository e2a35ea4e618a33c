"""``cacheblend-rag eval``: answer a data set with each method and score quality and fidelity."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..config import DECISIVE_MARGIN, DEFAULT_CHUNK_TOKENS
from ..errors import CacheBlendError
from .output import print_error, shown
from .progress import ProgressReporter

if TYPE_CHECKING:
    from ..eval.records import EvalResults

console = Console()
err_console = Console(stderr=True)


def settings_prefix() -> list[str]:
    """``CACHEBLEND_*=value`` for every setting that differs from its default (they change results)."""
    from ..settings import Settings, get_settings

    current, defaults = get_settings(), Settings.model_fields
    out = []
    for name, info in defaults.items():
        if name == "home":
            continue
        value = getattr(current, name)
        if info.default is not None and value != info.default:
            out.append(f"CACHEBLEND_{name.upper()}={value}")
    return out


def command_line(command: str, arguments: list[str], options: dict[str, object]) -> str:
    """The command as it can be typed again, recorded with its results: the settings that differ from
    their defaults, then ``cacheblend-rag COMMAND ARGUMENTS --OPTION VALUE`` (None options left out)."""
    flags = [part for flag, value in options.items() if value is not None for part in (flag, str(value))]
    return shlex.join([*settings_prefix(), "cacheblend-rag", command, *arguments, *flags])


def parse_list(text: str, kind: type, option: str) -> list:
    try:
        values = [kind(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"{option}: expected a comma-separated list, got {text!r}") from None
    if not values:
        raise typer.BadParameter(f"{option}: give at least one value")
    return values


def eval_command(
    data: Annotated[
        str,
        typer.Option(
            "--data",
            help="A data file ({question, answers, ctxs} JSON) or musique, musique-heldout or multinews "
            "(cut with --chunk-tokens: --data multinews --chunk-tokens 128 is its short-passage set).",
        ),
    ] = "musique",
    methods: Annotated[
        str,
        typer.Option(
            help="Comma-separated methods or specs (epic@32, cacheblend_hkvd@ratio=0.3,signal=v); a method "
            "with a ratio given without one (cacheblend) runs once per --ratios value; default: the method "
            "setting, as query runs it."
        ),
    ] = "full_recompute,prefix_cache,full_reuse,cacheblend,epic",
    ratios: Annotated[str, typer.Option(help="CacheBlend recompute ratios.")] = "0,0.05,0.1,0.15,0.2,0.3,0.5",
    limit: Annotated[
        int | None, typer.Option(min=1, help="Evaluate N cases chosen by --seed (all if unset).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the case selection.")] = 0,
    skip: Annotated[
        int,
        typer.Option(
            min=0,
            help="Leave out the first N cases of the seeded order (--skip 60 on the full MuSiQue file: the "
            "90 cases the shipped 60-case subset does not hold).",
        ),
    ] = 0,
    chunk_context: Annotated[
        str | None,
        typer.Option(
            "--chunk-context",
            help="What chunk KV is precomputed behind: neutral or none (default: the chunk_context "
            "setting); a method written none:SPEC uses none whatever this says.",
        ),
    ] = None,
    top_k: Annotated[int, typer.Option("--top-k", min=1, help="Chunks per prompt.")] = 6,
    chunk_tokens: Annotated[
        int, typer.Option("--chunk-tokens", min=16, help="Most tokens per chunk.")
    ] = DEFAULT_CHUNK_TOKENS,
    max_new_tokens: Annotated[
        int | None, typer.Option("--max-new-tokens", min=1, help="Default: 32 for QA, 64 for summaries.")
    ] = None,
    task: Annotated[
        str, typer.Option(help="auto, qa or summary (auto: summary when no case has a question).")
    ] = "auto",
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Results file; rerunning with it skips finished cases.")
    ] = None,
    markdown: Annotated[
        Path | None, typer.Option("--markdown", help="Write the results table into this file's eval section.")
    ] = None,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Save the quality-vs-TTFT plot (PNG) here.")
    ] = None,
    kv_dir: Annotated[
        Path | None,
        typer.Option("--kv-dir", help="Chunk KV store kept across runs (default: settings home)."),
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="Model name or local HF folder.")] = None,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            help="What answers: torch (our engine) or vllm (vLLM with the CacheBlend connector; scores "
            "no NLL, and runs one chunk context and codec).",
        ),
    ] = "torch",
    kv_dtypes: Annotated[
        str | None,
        typer.Option(
            "--kv-dtypes",
            help="Compare chunk KV codecs, e.g. float16,int8,int4: every method (but full_recompute, "
            "computed once per case) once per codec; the first is the baseline of the deltas table.",
        ),
    ] = None,
    decisive_margin: Annotated[
        float,
        typer.Option(
            "--decisive-margin",
            min=0.0,
            help="Nats by which full prefill's first token must lead its runner-up for a case to be "
            "decisive; first-token agreement is reported on decisive cases and on near-ties apart.",
        ),
    ] = DECISIVE_MARGIN,
) -> None:
    """Answer each case with every method; score against the gold answers and the full_recompute answer."""
    from ..blend.spec import named_default, split_specs
    from ..engine import ENGINE_KINDS
    from ..eval.datasets import load_dataset
    from ..eval.harness import EvalConfig, run_eval
    from ..eval.headline import HEADLINE_SECTION, render_headline
    from ..eval.markdown import update_markdown
    from ..eval.report import eval_section_name, plot_quality_vs_ttft, render_eval
    from ..eval.variants import CHUNK_CONTEXTS
    from ..settings import get_settings

    if engine not in ENGINE_KINDS:
        raise typer.BadParameter(f"--engine: use {' or '.join(ENGINE_KINDS)}, got {engine!r}")
    if chunk_context is not None and chunk_context not in CHUNK_CONTEXTS:
        raise typer.BadParameter(f"--chunk-context: use {' or '.join(CHUNK_CONTEXTS)}, got {chunk_context!r}")
    method_list = [named_default(text, get_settings().method) for text in split_specs(methods)]
    if not method_list:
        raise typer.BadParameter("--methods: give at least one method")
    ratio_list = parse_list(ratios, float, "--ratios")
    try:
        dataset_name = load_dataset(data).name
        json_path = json_path or Path(f"eval-{dataset_name}.json")
        command = command_line(
            "eval",
            [],
            {
                "--data": data,
                "--methods": methods,
                "--ratios": ratios,
                "--limit": limit,
                "--seed": seed,
                "--skip": skip or None,
                "--chunk-context": chunk_context,
                "--top-k": top_k,
                "--chunk-tokens": chunk_tokens,
                "--max-new-tokens": max_new_tokens,
                "--task": task if task != "auto" else None,
                "--model": model,
                "--engine": engine if engine != "torch" else None,
                "--kv-dtypes": kv_dtypes,
                "--decisive-margin": decisive_margin if decisive_margin != DECISIVE_MARGIN else None,
                "--json": json_path,
                "--markdown": markdown,
                "--plot": plot,
            },
        )
        config = EvalConfig(
            data=data,
            methods=method_list,
            ratios=ratio_list,
            limit=limit,
            seed=seed,
            top_k=top_k,
            chunk_tokens=chunk_tokens,
            max_new_tokens=max_new_tokens,
            task=task,
            model=model,
            kv_dir=kv_dir,
            json_path=json_path,
            command=command,
            skip=skip,
            chunk_context=chunk_context,
            kv_dtypes=tuple(parse_list(kv_dtypes, str, "--kv-dtypes")) if kv_dtypes else (),
            engine=engine,
            decisive_margin=decisive_margin,
        )

        with ProgressReporter(err_console, {"cases": "eval (cases)"}) as progress:
            results = run_eval(config, on_case=lambda done, total, _: progress.update("cases", done, total))
        if plot is not None:
            plot_quality_vs_ttft(results, plot)
        if markdown is not None:
            update_markdown(markdown, eval_section_name(results), render_eval(results, markdown, plot))
            update_markdown(markdown, HEADLINE_SECTION, render_headline(json_path.parent))
    except (CacheBlendError, ValueError) as exc:
        print_error(err_console, exc)
        raise typer.Exit(1) from exc
    _print_summary(results)
    err_console.print(f"results: {shown(json_path)}")


def _print_summary(results: EvalResults) -> None:
    from ..eval.report import split_cells

    summary = results.summarized()
    table = Table(title=f"{shown(results.config.dataset)}: {summary.cases} cases")
    for column in (
        "method",
        "chunk recompute",
        "TTFT med (s)",
        "gold",
        "agreement",
        "1st token",
        "decisive (n)",
        "near-tie (n)",
        "KL",
        "NLL ref",
    ):
        table.add_column(column, justify="right")

    def cells(*values: float | None) -> list[str]:
        return [f"{value:.3f}" if value is not None else "–" for value in values]

    for label, e in summary.methods.items():
        table.add_row(
            shown(label),
            *cells(e.chunk_recompute_ratio, e.ttft_median_s, e.gold, e.agreement_f1, e.first_token_agreement),
            *split_cells(e),
            *cells(e.kl_first_token, e.nll_reference),
        )
    console.print(table)
    margin = summary.decisive_margin if summary.decisive_margin is not None else DECISIVE_MARGIN
    console.print(
        f"decisive: full prefill's first token leads its runner-up by >= {margin:g} nats; near-tie: the rest",
        highlight=False,
    )
    for check in summary.checks:
        console.print(f"{'PASS' if check.passed else 'FAIL'}: {check.claim}", highlight=False)
