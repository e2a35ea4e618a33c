"""``cacheblend-rag gpu-check``: the accelerator check (``python -m cacheblend_rag.eval.gpu``, which runs
where only torch and numpy are installed), its arguments passed through."""

from __future__ import annotations

import typer

# every argument, --help included, is the check's own (argparse parses them)
GPU_CHECK_SETTINGS = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def gpu_check_command(ctx: typer.Context) -> None:
    """Time CacheBlend against full prefill on one accelerator and check r = 1 is exact (--help: its
    options)."""
    from ..eval.gpu.check import main

    code = main(list(ctx.args), prog="cacheblend-rag gpu-check")
    if code:
        raise typer.Exit(code)
