"""What a bench section's renderer is given beside its own results: the page it renders into."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..markdown import checks_list, machine_line, relative_link
from .record import Check, SectionFrame


@dataclass(frozen=True)
class Page:
    """What every section renderer may refer to: all results, the markdown file, the plots made."""

    results: dict[str, Any]
    markdown: Path
    plots: dict[str, Path]

    def header(self, title: str, name: str) -> list[str]:
        frame = SectionFrame.from_dict(self.results["sections"][name])
        load = frame.load_average
        command = self.results.get("commands", {}).get(name) or "cacheblend-rag bench"
        return [
            "",
            f"### {title}",
            "",
            f"`{command}` (section `{name}`, {frame.seconds:.0f} s). "
            f"Machine: {machine_line(frame.machine)}; 1-min load average "
            f"{load.before[0]:.1f} before, {load.after[0]:.1f} after.",
            "",
        ]

    def plot(self, name: str, alt: str) -> list[str]:
        """The plot ``name`` as an image line after a blank one, when this run drew it."""
        if name not in self.plots:
            return []
        return ["", f"![{alt}]({relative_link(self.plots[name], self.markdown)})"]


def checks_lines(checks: Sequence[Check]) -> str:
    """The checks as a PASS/FAIL list."""
    return checks_list([c.to_dict() for c in checks])
