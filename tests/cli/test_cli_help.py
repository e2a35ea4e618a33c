"""``--help`` of every command wraps its text at words: a docstring's line breaks are where its source lines
end, not where a terminal's do, so no help text may break a sentence there; and text in brackets (the
``[vllm]`` extra) is printed, not read as markup and dropped."""

from __future__ import annotations

import inspect

import click
import pytest
import typer
from typer.testing import CliRunner

from cacheblend_rag.cli import app, flowed


def commands() -> list[tuple[list[str], click.Command]]:
    """Every command of the CLI with the arguments that reach it (groups too)."""
    found: list[tuple[list[str], click.Command]] = []

    def walk(path: list[str], command: click.Command) -> None:
        found.append((path, command))
        for name, sub in getattr(command, "commands", {}).items():
            walk([*path, name], sub)

    walk([], typer.main.get_command(app))
    return found


def rendered(arguments: list[str], columns: int) -> list[str]:
    result = CliRunner().invoke(app, [*arguments, "--help"], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    # the text of each line, the panels' borders and padding left out
    return [" ".join(line.strip(" │╭╮╰╯─").split()) for line in result.output.splitlines()]


@pytest.mark.parametrize(
    "arguments", [path for path, command in commands() if path != ["gpu-check"]], ids=str
)
def test_help_wraps_at_words_not_at_the_docstrings_line_breaks(arguments):
    command = dict((tuple(p), c) for p, c in commands())[tuple(arguments)]
    paragraphs = flowed(inspect.cleandoc(command.help or "")).split("\n\n")
    # so wide that nothing needs wrapping: each paragraph of the description is one line of the page
    lines = rendered(arguments, 1000)
    for paragraph in paragraphs:
        assert paragraph in lines, (paragraph, lines)
    # and in the parent's list of commands, the first paragraph is one line too
    if arguments:
        assert any(line.endswith(paragraphs[0]) for line in rendered(arguments[:-1], 1000)), paragraphs[0]
    # at 80 columns, every line but a paragraph's last is full: the next word would not have fitted
    lines = rendered(arguments, 80)
    for paragraph in paragraphs:
        words = paragraph.split()
        start = next(i for i, line in enumerate(lines) if line and paragraph.startswith(line))
        taken = 0
        for line in lines[start:]:
            taken += len(line.split())
            if taken >= len(words):
                break
            assert len(line) + 1 + len(words[taken]) > 78, (line, words[taken])


def test_bracketed_text_in_option_help_is_printed():
    for arguments in (["query"], ["serve"], ["bench"]):
        assert "[vllm] extra" in " ".join(rendered(arguments, 1000)), arguments
