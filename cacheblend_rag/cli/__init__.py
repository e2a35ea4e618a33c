"""The ``cacheblend-rag`` command line."""

from __future__ import annotations

import logging
import os

import typer

from ..settings import SettingsError, get_settings
from .bench import bench_command
from .check import check_command
from .eval import eval_command
from .gpu_check import GPU_CHECK_SETTINGS, gpu_check_command
from .ingest import ingest
from .models import models_app
from .profile import profile
from .query import query
from .serve import serve
from .store import store_app
from .tune import tune_command

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Fast RAG by blending precomputed KV caches."
)
app.add_typer(models_app, name="models")
app.add_typer(store_app, name="store")
app.command("profile")(profile)
app.command("ingest")(ingest)
app.command("query")(query)
app.command("eval")(eval_command)
app.command("bench")(bench_command)
app.command("gpu-check", context_settings=GPU_CHECK_SETTINGS)(gpu_check_command)
app.command("tune")(tune_command)
app.command("check")(check_command)
app.command("serve")(serve)


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at INFO level.")) -> None:
    from rich.console import Console
    from rich.logging import RichHandler

    # The hub's and transformers' progress bars ("Loading weights", once per model the process loads)
    # say nothing a user of this command needs; read when those libraries load, inherited by children.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        # logs go to stderr: stdout holds what a command prints (query --json)
        handlers=[RichHandler(console=Console(stderr=True), show_path=False)],
        format="%(message)s",
    )
    try:
        get_settings()  # a bad CACHEBLEND_* variable stops every command here, named
    except SettingsError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
