"""What every command prints the same way."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape


def shown(value: object) -> str:
    """``value`` as text that Rich prints verbatim: user-supplied strings (paths, questions, chunk text,
    error messages quoting them) may hold ``[...]``, which Rich would otherwise read as markup and drop."""
    return escape(str(value))


def print_error(console: Console, message: object, **options: Any) -> None:
    """``error: message`` on ``console``, soft-wrapped: Rich would break a path longer than the console in
    the middle, and the path could not be copied or searched for as printed. The message is printed as
    written (no markup read from it). ``options`` go to :meth:`Console.print`."""
    console.print(f"[red]error:[/red] {shown(message)}", soft_wrap=True, **options)
