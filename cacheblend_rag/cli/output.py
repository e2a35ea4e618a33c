"""What every command prints the same way."""

from __future__ import annotations

from typing import Any

from rich.console import Console


def print_error(console: Console, message: object, **options: Any) -> None:
    """``error: message`` on ``console``, soft-wrapped: Rich would break a path longer than the console in
    the middle, and the path could not be copied or searched for as printed. ``options`` go to
    :meth:`Console.print`."""
    console.print(f"[red]error:[/red] {message}", soft_wrap=True, **options)
