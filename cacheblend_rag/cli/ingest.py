"""``cacheblend-rag ingest``: build or update a corpus directory from files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..errors import CacheBlendError
from .output import print_error, shown
from .overrides import KV_REMOTE_OPTION, use_kv_remote
from .progress import ProgressReporter

console = Console()
err_console = Console(stderr=True)

_STAGE_LABELS = {
    "read": "read + chunk (files)",
    "embed": "embed (new chunks)",
    "index": "index",
    "kv": "precompute KV (chunks)",
}


def ingest(
    paths: Annotated[list[Path], typer.Argument(help="Files or folders (.txt, .md, .html, .pdf, .jsonl).")],
    corpus: Annotated[Path, typer.Option("--corpus", help="Corpus directory (created if missing).")],
    chunk_tokens: Annotated[
        int | None, typer.Option("--chunk-tokens", help="Max tokens per chunk of a new corpus (default 512).")
    ] = None,
    index: Annotated[
        str | None, typer.Option("--index", help="Vector index: flat (exact), ivf or hnsw.")
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Model name or local Hugging Face folder.")
    ] = None,
    no_kv: Annotated[
        bool, typer.Option("--no-kv", help="Skip KV precompute (done on first use instead).")
    ] = False,
    kv_remote: Annotated[str | None, KV_REMOTE_OPTION] = None,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict", help="Stop at the first file that cannot be read (default: skip it, ingest the rest)."
        ),
    ] = False,
) -> None:
    """Read, chunk, embed and index documents and precompute their chunks' KV. Unchanged files are skipped.
    With a remote KV tier every chunk is pinned there (computed only if no tier holds it). A file that
    cannot be read is left out (nothing of it stored) and named at the end, with exit code 1."""
    from transformers.utils import logging as hf_logging

    from ..ingest.pipeline import ingest as run_ingest

    hf_logging.disable_progress_bar()  # our own bars only
    try:
        settings = use_kv_remote(kv_remote)
        # a bar (or, when stderr is not a terminal, progress lines) for each stage as it starts
        with ProgressReporter(err_console, _STAGE_LABELS) as progress:
            summary = run_ingest(
                paths,
                corpus,
                model=model,
                progress=progress.update,
                chunk_tokens=chunk_tokens,
                index_type=index,
                precompute_kv=not no_kv,
                skip_unreadable=not strict,
                config=settings,
            )
    except (CacheBlendError, ValueError) as exc:
        print_error(err_console, exc, highlight=False)
        raise typer.Exit(1) from exc
    except KeyboardInterrupt:
        err_console.print("interrupted: files committed so far are kept; run the command again to resume")
        raise typer.Exit(130) from None

    table = Table(title=f"ingest into {shown(summary.corpus_dir)}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row(
        "files",
        f"{summary.files} ({summary.files_changed} new or changed, {summary.files_unchanged} unchanged)",
    )
    table.add_row("documents", str(summary.documents))
    table.add_row("chunks", f"{summary.chunks} ({summary.new_chunks} new, {summary.removed_chunks} removed)")
    table.add_row("tokens", f"{summary.tokens:,}")
    table.add_row("KV", f"{summary.kv_chunks} chunks, {summary.kv_bytes / 2**20:,.1f} MiB")
    if summary.kv_remote_pinned is not None:
        table.add_row("remote KV tier", f"{summary.kv_remote_pinned} chunks pinned")
    table.add_row("time", f"{summary.seconds:.1f} s")
    for stage, seconds in summary.stage_seconds.items():
        table.add_row(f"  {stage}", f"{seconds:.1f} s")
    table.add_row("chunks/s", f"{summary.chunks_per_s:.1f}")
    table.add_row("tokens/s", f"{summary.tokens_per_s:,.0f}")
    console.print(table)
    if summary.skipped:
        skipped = Table(title=f"{len(summary.skipped)} file(s) skipped (not ingested)")
        skipped.add_column("file", overflow="fold")
        skipped.add_column("why", overflow="fold")
        for path, why in summary.skipped:
            skipped.add_row(shown(path), shown(why))
        err_console.print(skipped)
        err_console.print("fix them and run the command again (--strict stops at the first instead)")
        raise typer.Exit(1)
