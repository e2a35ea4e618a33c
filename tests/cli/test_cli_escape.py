"""User-supplied text reaches the terminal as written: paths, file names and messages holding ``[...]``
are not read as Rich markup (which would drop ``[b]`` or ``[red]`` and style the rest)."""

from __future__ import annotations

import io

from rich.console import Console
from typer.testing import CliRunner

from cacheblend_rag.cli import app
from cacheblend_rag.cli.output import print_error

ODD = "x[b]y[/b]-[red]z"


def run_cli(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, " ".join(result.output.split())


def test_print_error_prints_brackets_verbatim():
    out = io.StringIO()
    print_error(Console(file=out, width=200), f"cannot read /data/{ODD}/a.txt: bad value [1, 2]")
    assert out.getvalue().strip() == f"error: cannot read /data/{ODD}/a.txt: bad value [1, 2]"


def test_a_corpus_path_with_brackets_is_named_whole(tmp_path):
    corpus = tmp_path / ODD / "corpus"
    code, output = run_cli("query", "what is [b]this[/b]?", "--corpus", corpus)
    assert code == 1
    assert f"{corpus} is not a cacheblend-rag store" in output


def test_skipped_file_names_and_the_corpus_path_keep_their_brackets(tmp_path, embedder):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "good.md").write_text("The Rhine flows from the Swiss Alps into the North Sea.\n")
    (docs / "[draft] notes.txt").write_text("")  # empty: skipped, and named in the table of skipped files
    corpus = tmp_path / "[v2]" / "corpus"
    code, output = run_cli("ingest", docs, "--corpus", corpus, "--no-kv")
    assert code == 1, output
    assert "[draft] notes.txt" in output
    assert "[v2]" in output  # the corpus path in the summary's title (Rich may fold it)
