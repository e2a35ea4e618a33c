"""``cacheblend-rag query``: answer a question from an ingested corpus."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..errors import CacheBlendError
from .output import print_error, shown
from .overrides import KV_REMOTE_OPTION, use_kv_remote

console = Console()
err_console = Console(stderr=True)


def query(
    corpus: Annotated[Path, typer.Option("--corpus", help="Corpus directory built by `ingest`.")],
    question: Annotated[str | None, typer.Argument(help="The question to answer.")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", help="Chunks to retrieve (default 6).")] = None,
    method: Annotated[
        str | None,
        typer.Option(
            help="A method, with options if any: cacheblend (default), cacheblend@0.3, "
            "cacheblend_hkvd@ratio=0.3,signal=v, full_recompute, full_reuse, prefix_cache, epic, epic@k=32, "
            "or a registered method of your own."
        ),
    ] = None,
    ratio: Annotated[
        float | None,
        typer.Option(
            help="Recompute ratio of a method that has one (default: the loading controller's, at least "
            "the ratio setting)."
        ),
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option("--max-tokens", help="Most tokens to generate (default: the max_tokens setting, 256)."),
    ] = None,
    temperature: Annotated[float, typer.Option(help="0 for greedy.")] = 0.0,
    chunk_id: Annotated[
        list[str] | None,
        typer.Option("--chunk-id", help="Use these chunks instead of retrieving (repeatable)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON object with timings.")] = False,
    stream: Annotated[bool, typer.Option("--stream", help="Print tokens as they are generated.")] = False,
    model: Annotated[str | None, typer.Option("--model", help="Model (default: the corpus's).")] = None,
    engine: Annotated[
        str | None, typer.Option("--engine", help="torch (default) or vllm (needs the \\[vllm] extra).")
    ] = None,
    batch: Annotated[
        Path | None,
        typer.Option(
            "--batch",
            help='Answer every question in FILE (one per line, or JSON Lines with "question") together, '
            "batched by the engine (the PyTorch batch scheduler, or vLLM itself).",
        ),
    ] = None,
    kv_remote: Annotated[str | None, KV_REMOTE_OPTION] = None,
) -> None:
    """Retrieve the top chunks, blend their cached KV and answer."""
    from ..engine import SamplingParams
    from ..engine.bounds import check_request
    from ..rag import CacheBlendRAG

    try:
        settings = use_kv_remote(kv_remote)
        max_tokens = settings.max_tokens if max_tokens is None else max_tokens
        # every bound before the model loads (seconds), worded as every other entry point words it
        check_request(
            method or settings.method,
            ratio=ratio,
            question=question,
            top_k=top_k,
            max_tokens=max_tokens,
            temperature=temperature,
        )
    except (CacheBlendError, ValueError) as exc:
        print_error(err_console, exc)
        raise typer.Exit(2) from exc
    if (question is None) == (batch is None):
        print_error(err_console, "give either a QUESTION or --batch FILE")
        raise typer.Exit(2)
    if batch is not None:
        if stream:
            print_error(err_console, "--stream does not apply to --batch")
            raise typer.Exit(2)
        from .batch_query import query_batch_command

        query_batch_command(
            batch,
            corpus,
            top_k,
            method,
            ratio,
            max_tokens,
            temperature,
            chunk_id,
            as_json,
            model,
            engine,
            settings,
        )
        return
    try:
        rag = CacheBlendRAG(corpus, model=model, engine_kind=engine, config=settings)
        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        handle = rag.stream(
            question, top_k=top_k, method=method, ratio=ratio, chunk_ids=chunk_id, sampling=sampling
        )
        for event in handle:
            if stream and not as_json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
        result = handle.result()
    except (CacheBlendError, ValueError) as exc:
        print_error(err_console, exc)
        raise typer.Exit(1) from exc
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    if stream:
        print()
    else:
        console.print(result.answer, markup=False, highlight=False)
    table = Table(show_header=False, box=None)
    table.add_row("method", shown(result.method))
    table.add_row("TTFT", f"{result.ttft_s * 1000:.0f} ms")
    table.add_row("total", f"{result.total_s:.2f} s")
    table.add_row(
        "read from cache",
        f"{result.cached_tokens} tokens ({result.cache_read_exact_tokens} exact prefix, "
        f"{result.cache_read_blended_tokens} blended)",
    )
    table.add_row("recomputed", f"{result.computed_tokens} tokens")
    if result.budget is not None:
        table.add_row("budget", result.budget.text())
    table.add_row("chunk KV computed now", f"{result.kv_computed_tokens} tokens")
    table.add_row("chunks", shown(", ".join(result.chunk_ids)))
    err_console.print(table)
