"""``cacheblend-rag ingest``: progress and summary, incremental re-runs, KV precompute, clean failures."""

from __future__ import annotations

import shutil
from pathlib import Path

from typer.testing import CliRunner

from cacheblend_rag.cli import app
from cacheblend_rag.corpus.corpus import Corpus

SAMPLE_FILE = Path(__file__).parents[2] / "examples" / "data" / "corpus" / "musique_case013.txt"


def run_cli(*args: str):
    """Exit code, stdout + stderr and stderr alone, whitespace-normalised (Rich wraps long lines)."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, " ".join(result.output.split()), " ".join(result.stderr.split())


def test_ingest_prints_summary_and_rerun_is_a_noop(tmp_path, embedder):
    store = tmp_path / "store"
    code, output, stderr = run_cli("ingest", SAMPLE_FILE, "--corpus", store, "--no-kv")
    assert code == 0, output
    assert "1 (1 new or changed, 0 unchanged)" in output
    assert "chunks/s" in output and "tokens/s" in output
    with Corpus.open(store) as corpus:
        stats = corpus.stats()
    assert f"{stats.chunks} ({stats.chunks} new, 0 removed)" in output
    # not a terminal: progress lines, not bars
    assert f"embed (new chunks): {stats.chunks}/{stats.chunks} (100%)" in stderr and "━" not in stderr

    code, output, _ = run_cli("ingest", SAMPLE_FILE, "--corpus", store, "--no-kv")
    assert code == 0, output
    assert "1 (0 new or changed, 1 unchanged)" in output


def test_ingest_with_kv_precompute(tmp_path, embedder):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "short.md").write_text("# Note\n\nThe Rhine flows from the Swiss Alps into the North Sea.\n")
    store = tmp_path / "store"
    code, output, _ = run_cli("ingest", docs, "--corpus", store, "--chunk-tokens", "32")
    assert code == 0, output
    with Corpus.open(store) as corpus:
        stats = corpus.stats()
    assert stats.chunks >= 1 and stats.kv_ready == stats.chunks
    assert f"KV │ {stats.chunks} chunks" in output
    assert (store / "kv").is_dir()


def test_errors_exit_nonzero_with_a_message_on_stderr(tmp_path, embedder):
    code, _, stderr = run_cli("ingest", tmp_path / "missing.txt", "--corpus", tmp_path / "s")
    assert code == 1 and stderr.startswith("error:") and "missing.txt: no such file or directory" in stderr
    assert not (tmp_path / "s").exists()

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"id": 2}\n')
    code, _, stderr = run_cli("ingest", bad, "--corpus", tmp_path / "s", "--no-kv")
    assert code == 1 and "bad.jsonl:2: record has no 'text' field" in stderr
    assert not (tmp_path / "s").exists()

    shutil.copy(SAMPLE_FILE, tmp_path / "a.txt")
    code, _, stderr = run_cli("ingest", tmp_path / "a.txt", "--corpus", tmp_path / "s", "--index", "annoy")
    assert code == 1 and "unknown index type 'annoy'" in stderr
    code, _, stderr = run_cli("ingest", tmp_path / "a.txt", "--corpus", tmp_path / "s", "--chunk-tokens", "4")
    assert code == 1 and "at least 16 tokens" in stderr


def test_an_error_naming_a_long_path_keeps_it_on_one_line(tmp_path):
    """Rich would break a path longer than the console (80 columns off a terminal) in the middle; the
    error line is soft-wrapped instead, so the path can be copied and searched for as printed."""
    missing = tmp_path / ("a-folder-with-a-long-name-" * 4) / "missing.txt"
    assert len(f"error: {missing}") > 100
    result = CliRunner().invoke(app, ["ingest", str(missing), "--corpus", str(tmp_path / "s")])
    assert result.exit_code == 1
    assert f"error: {missing}: no such file or directory" in result.stderr, result.stderr


def test_a_folder_ingest_skips_unreadable_files_names_them_and_exits_1(tmp_path, embedder, monkeypatch):
    """Two good files, one empty, one not UTF-8."""
    monkeypatch.setenv("COLUMNS", "400")  # the table's paths on one line each
    folder = tmp_path / "docs"
    folder.mkdir()
    shutil.copy(SAMPLE_FILE, folder / "a.txt")
    (folder / "b.md").write_text("# Lighthouse\n\nThe lighthouse on Gull Rock was built in 1871.\n")
    (folder / "empty.txt").write_bytes(b"")
    (folder / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))

    code, output, stderr = run_cli("ingest", folder, "--corpus", tmp_path / "strict", "--no-kv", "--strict")
    assert code == 1 and "file is empty" in stderr  # the first problem, and nothing stored
    assert not (tmp_path / "strict").exists()

    store = tmp_path / "store"
    code, output, stderr = run_cli("ingest", folder, "--corpus", store, "--no-kv")
    assert code == 1 and "2 file(s) skipped" in stderr
    assert f"{folder}/empty.txt │ file is empty" in stderr
    assert f"{folder}/latin1.txt │" in stderr and "UTF-8" in stderr
    assert "4 (2 new or changed, 0 unchanged)" in output  # the good files are in
    with Corpus.open(store) as corpus:
        assert corpus.stats().files == 2
        assert corpus.db.file_hash(str(folder / "a.txt")) and corpus.db.file_hash(str(folder / "b.md"))
        assert corpus.db.file_hash(str(folder / "empty.txt")) is None  # nothing of a skipped file

    # fixed, the same command ingests the rest and exits 0
    (folder / "empty.txt").write_text("Now it holds a sentence.\n")
    (folder / "latin1.txt").write_text("café au lait\n")
    code, output, stderr = run_cli("ingest", folder, "--corpus", store, "--no-kv")
    assert code == 0, stderr
    assert "4 (2 new or changed, 2 unchanged)" in output
