"""The ``cacheblend-rag`` command line."""

from __future__ import annotations

import inspect
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


def flowed(text: str) -> str:
    """``text`` with its paragraphs' line breaks made spaces: in Rich markup mode Typer keeps a docstring's
    single line breaks, so a command list and a help page broke sentences where the source lines end (``A
    file that`` / ``cannot be read``); flowed, Rich wraps them at words to the terminal's width."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in paragraphs)


def _flow_help(typer_app: typer.Typer) -> None:
    """Give every command of ``typer_app`` and of its sub-apps its docstring flowed as its help."""
    for info in typer_app.registered_commands:
        text = info.help or (info.callback.__doc__ if info.callback else None)
        if text:
            info.help = flowed(text)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _flow_help(group.typer_instance)


_flow_help(app)


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
