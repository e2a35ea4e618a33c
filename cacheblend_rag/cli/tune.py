"""``cacheblend-rag tune``: the fusor's variants on a development split, one table (docs/fusor.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from ..config import DEFAULT_CHUNK_TOKENS
from ..errors import CacheBlendError
from .eval import command_line
from .output import print_error, shown
from .progress import ProgressReporter

err_console = Console(stderr=True)


def tune_command(
    variants: Annotated[
        list[str] | None,
        typer.Argument(
            help="Variants: \\[none:]SPEC, e.g. cacheblend_hkvd@ratio=0.15,signal=v (default: the "
            "sweep that chose the defaults)."
        ),
    ] = None,
    data: Annotated[str, typer.Option("--data", help="Data file or musique / multinews.")] = "musique",
    limit: Annotated[int | None, typer.Option(min=1, help="Cases (default: all).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the case selection.")] = 0,
    skip: Annotated[int, typer.Option(min=0, help="Leave out the first N cases of the seeded order.")] = 0,
    chunk_tokens: Annotated[
        int, typer.Option("--chunk-tokens", min=16, help="Most tokens per chunk.")
    ] = DEFAULT_CHUNK_TOKENS,
    top_k: Annotated[int, typer.Option("--top-k", min=1, help="Chunks per prompt.")] = 6,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Results file; rerunning with it skips finished cases.")
    ] = None,
    markdown: Annotated[
        Path | None, typer.Option("--markdown", help="Write the table into this file's tune section.")
    ] = None,
) -> None:
    """Answer a development split with each variant and tabulate how closely each tracks full prefill."""
    from ..eval.datasets import load_dataset
    from ..eval.harness import EvalConfig, run_eval
    from ..eval.markdown import update_markdown
    from ..eval.tune import DEFAULT_VARIANTS, render_tune, tune_section_name

    chosen = list(variants or DEFAULT_VARIANTS)
    try:
        name = load_dataset(data).name
        json_path = json_path or Path(f"tune-{name}-{chunk_tokens}.json")
        command = command_line(
            "tune",
            chosen,
            {
                "--data": data,
                "--limit": limit,
                "--seed": seed,
                "--skip": skip or None,
                "--chunk-tokens": chunk_tokens,
                "--top-k": top_k,
                "--json": json_path,
                "--markdown": markdown,
            },
        )
        config = EvalConfig(
            data=data,
            methods=chosen,
            ratios=(),
            limit=limit,
            seed=seed,
            skip=skip,
            top_k=top_k,
            chunk_tokens=chunk_tokens,
            json_path=json_path,
            command=command,
        )

        with ProgressReporter(err_console, {"cases": "tune (cases)"}) as progress:
            results = run_eval(config, on_case=lambda done, total, _: progress.update("cases", done, total))
        body = render_tune(results)
        if markdown is not None:
            update_markdown(markdown, tune_section_name(results), body)
    except (CacheBlendError, ValueError) as exc:
        print_error(err_console, exc)
        raise typer.Exit(1) from exc
    print(body)
    err_console.print(f"results: {shown(json_path)}")
