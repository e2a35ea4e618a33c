"""``cacheblend-rag profile``: measure prefill and KV load costs for the loading controller."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ..errors import CacheBlendError
from .output import print_error, shown

console = Console()
CORPUS_OPTION = typer.Option(
    None, "--corpus", help="Measure disk reads on the disk of this corpus directory's KV store."
)
OUTPUT_OPTION = typer.Option(None, "--output", help="Where to save the profile (default: settings home).")


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated token counts, got {text!r}") from None
    if not lengths or min(lengths) <= 0:
        raise typer.BadParameter("token counts must be positive")
    return lengths


def profile(
    model: str = typer.Option(None, "--model", help="Model name or local HF folder (default: settings)."),
    lengths: str = typer.Option("256,512,1024,2048,4096", help="Context lengths to time prefill at."),
    kv_dtype: str = typer.Option(None, "--kv-dtype", help="Storage dtype (default: settings.kv_dtype)."),
    chunk_tokens: int = typer.Option(512, help="Tokens per chunk for the load measurements."),
    repeats: int = typer.Option(3, min=1, help="Runs per measurement (the best is kept)."),
    corpus: Path = CORPUS_OPTION,
    output: Path = OUTPUT_OPTION,
) -> None:
    """Measure one layer's full-prefill time vs context length and each tier's load throughput."""
    from ..blend.controller import LoadingController, profile_path
    from ..models.loader import load_model
    from ..settings import get_settings
    from ..store.profile import profile_device

    settings = get_settings()
    try:
        m = load_model(model or settings.model, config=settings)
        work_dir = corpus / "kv" if corpus is not None else settings.home
        result = profile_device(
            m,
            _lengths(lengths),
            kv_dtype or settings.kv_dtype,
            chunk_tokens=chunk_tokens,
            repeats=repeats,
            work_dir=work_dir,
        )
    except CacheBlendError as exc:
        print_error(console, exc)
        raise typer.Exit(1) from exc
    path = result.save(output or profile_path(m.fingerprint, m.device, settings.home))

    table = Table(
        title=f"{shown(m.name)} on {result.device} ({result.compute_dtype}, {result.threads} threads)"
    )
    table.add_column("context tokens", justify="right")
    table.add_column("ms / layer (full prefill)", justify="right")
    for tokens, seconds in result.prefill:
        table.add_row(str(tokens), f"{seconds * 1e3:.2f}")
    console.print(table)
    for tier, rate in result.tier_bytes_per_s.items():
        console.print(
            f"load from {tier}: {rate / 1e9:.2f} GB/s ({result.kv_dtype} -> {result.compute_dtype})"
        )
    controller = LoadingController(result, settings.ratio)
    example = controller.choose(6 * chunk_tokens, 6 * chunk_tokens + 64, "disk")
    console.print(
        f"example, 6 x {chunk_tokens} cached tokens from disk: r={example.ratio:.3f} ({example.reason})"
    )
    console.print(f"profile saved to {shown(path)}")
