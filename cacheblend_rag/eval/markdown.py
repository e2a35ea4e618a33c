"""BENCHMARKS.md: its sections and the pieces they are written with.

Each command owns one section, delimited by ``<!-- BEGIN name -->`` / ``<!-- END name -->`` and rewritten
whole from its results file, so the page only ever shows numbers a command produced.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MARKDOWN_HEADER = """# Benchmarks

Every number on this page was produced by the command shown with it, on the machine described with it;
`eval` and `bench` rewrite their own sections (between the `BEGIN`/`END` markers) from their JSON results
under `docs/results/`, which keep the raw per-case and per-run numbers. Times are wall-clock seconds.
"""


def update_markdown(path: str | Path, section: str, body: str) -> None:
    """Replace section ``section`` of the markdown file at ``path`` with ``body`` (append it if absent)."""
    path = Path(path)
    text = path.read_text() if path.is_file() else MARKDOWN_HEADER
    begin, end = f"<!-- BEGIN {section} -->", f"<!-- END {section} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n")


def relative_link(target: Path, markdown: Path) -> str:
    return Path(os.path.relpath(Path(target).resolve(), Path(markdown).resolve().parent)).as_posix()


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:.{digits}f}"


def machine_line(machine: dict[str, Any]) -> str:
    load = machine.get("load_average") or []
    return (
        f"{machine['cpu']}, {machine['cores']} cores, {machine['threads']} torch threads, torch "
        f"{machine['torch']}, transformers {machine['transformers']}, Python {machine['python']}"
        + (f"; load average at start {load[0]:.1f}" if load else "")
        + f" ({machine['timestamp']})"
    )


def checks_list(checks: Sequence[dict[str, Any]]) -> str:
    lines = []
    for check in checks:
        value = check.get("value")
        shown = f" ({value:.2f})" if isinstance(value, (int, float)) and not isinstance(value, bool) else ""
        lines.append(f"- {'PASS' if check['passed'] else 'FAIL'}: {check['claim']}{shown}")
    return "\n".join(lines)
