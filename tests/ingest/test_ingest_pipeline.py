"""The ingest pipeline without KV precompute: incremental runs, replacement, dedup, refusals, crash safety."""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from cacheblend_rag.corpus.chunkdb import DB_NAME, FAISS_INDEX_NAME, MANIFEST_NAME
from cacheblend_rag.corpus.corpus import Corpus
from cacheblend_rag.errors import ChunkNotFoundError, IngestError, StoreError
from cacheblend_rag.ingest.pipeline import ingest

LESSING = (
    "Emilia Galotti is a play in five acts by Gotthold Ephraim Lessing, first performed in 1772 in "
    "Braunschweig. It is an early German domestic tragedy.\n\n"
    "Miss Sara Sampson is a domestic tragedy by Lessing, first performed in 1755 in Frankfurt an der Oder.\n"
)
RIVERS = (
    "The Danube is the second-longest river in Europe. It flows through ten countries into the Black Sea.\n\n"
    "The Rhine rises in the Swiss Alps and flows into the North Sea in the Netherlands.\n"
)


def snapshot(store: Path) -> dict:
    """Everything a run could change: manifest, chunk table, index bytes."""
    with sqlite3.connect(store / DB_NAME) as db:
        rows = db.execute("SELECT chunk_id, text FROM chunks ORDER BY chunk_id").fetchall()
        files = db.execute("SELECT path, content_hash FROM files ORDER BY path").fetchall()
    return {
        "manifest": (store / MANIFEST_NAME).read_text(),
        "chunks": rows,
        "files": files,
        "index": (store / FAISS_INDEX_NAME).read_bytes() if (store / FAISS_INDEX_NAME).exists() else None,
    }


@pytest.fixture
def corpus_dir(tmp_path) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "lessing.md").write_text("# Lessing\n\n" + LESSING)
    (folder / "rivers.txt").write_text(RIVERS)
    return folder


def test_ingest_then_unchanged_rerun_is_a_noop(tmp_path, corpus_dir, embedder):
    store = tmp_path / "store"
    seen: list[tuple[str, int, int]] = []
    first = ingest([corpus_dir], store, precompute_kv=False, progress=lambda *a: seen.append(a))
    assert (first.files, first.files_changed, first.documents) == (2, 2, 2)
    assert first.chunks == first.new_chunks == 2 and first.tokens > 40
    assert {stage for stage, _, _ in seen} == {"read", "embed", "index"}
    assert ("embed", 2, 2) in seen and ("read", 2, 2) in seen
    before = snapshot(store)
    index_mtime = (store / FAISS_INDEX_NAME).stat().st_mtime_ns

    again = ingest([corpus_dir], store, precompute_kv=False)
    assert (again.files_changed, again.files_unchanged, again.chunks, again.new_chunks) == (0, 2, 0, 0)
    assert snapshot(store) == before
    assert (store / FAISS_INDEX_NAME).stat().st_mtime_ns == index_mtime
    assert oct((store).stat().st_mode & 0o777) == oct(0o750)  # not world-writable


def test_changed_file_replaces_its_chunks(tmp_path, corpus_dir, embedder):
    store = tmp_path / "store"
    ingest([corpus_dir], store, precompute_kv=False)
    with Corpus.open(store) as corpus:
        old = corpus.search("Which river flows into the Black Sea?", top_k=1)[0]
        assert "Danube" in old.text
    (corpus_dir / "rivers.txt").write_text(RIVERS.replace("Danube", "Donau"))
    summary = ingest([corpus_dir], store, precompute_kv=False)
    assert (summary.files_changed, summary.new_chunks, summary.removed_chunks) == (1, 1, 1)
    with Corpus.open(store) as corpus:
        with pytest.raises(ChunkNotFoundError):
            corpus.get_chunks([old.chunk_id])
        hit = corpus.search("Which river flows into the Black Sea?", top_k=1)[0]
        assert "Donau" in hit.text and "Danube" not in hit.text
        stats = corpus.stats()
        assert (stats.files, stats.documents, stats.chunks, stats.index_size) == (2, 2, 2, 2)


def test_identical_content_is_stored_once(tmp_path, corpus_dir, embedder):
    shutil.copy(corpus_dir / "rivers.txt", corpus_dir / "rivers_copy.txt")
    store = tmp_path / "store"
    summary = ingest([corpus_dir], store, precompute_kv=False)
    assert (summary.files, summary.chunks, summary.new_chunks) == (3, 3, 2)
    with Corpus.open(store) as corpus:
        stats = corpus.stats()
        assert (stats.documents, stats.chunks, stats.index_size) == (3, 2, 2)
        hits = corpus.search("Danube Black Sea", top_k=5)
        assert len({h.chunk_id for h in hits}) == len(hits) == 2
    # removing one copy's content keeps the chunk the other copy still uses
    (corpus_dir / "rivers_copy.txt").write_text(LESSING)
    summary = ingest([corpus_dir], store, precompute_kv=False)
    assert summary.removed_chunks == 0
    with Corpus.open(store) as corpus:
        assert corpus.search("Danube Black Sea", top_k=1)[0].text == RIVERS


def test_bad_file_stops_the_run_before_anything_is_written(tmp_path, corpus_dir, embedder):
    store = tmp_path / "store"
    (corpus_dir / "zz_broken.jsonl").write_text('{"text": "fine"}\n{"title": "no text"}\n')
    with pytest.raises(IngestError, match=r"zz_broken.jsonl:2: record has no 'text'"):
        ingest([corpus_dir], store, precompute_kv=False)
    assert not store.exists()
    (corpus_dir / "zz_broken.jsonl").unlink()
    ingest([corpus_dir], store, precompute_kv=False)
    before = snapshot(store)
    (corpus_dir / "rivers.txt").write_text("changed text that should not land")
    (corpus_dir / "zz_binary.txt").write_bytes(b"\x00\x01\x02")
    with pytest.raises(IngestError, match="binary"):
        ingest([corpus_dir], store, precompute_kv=False)
    assert snapshot(store) == before


def test_store_of_another_model_or_chunk_size_is_refused(tmp_path, corpus_dir, model_tokenizer, embedder):
    store = tmp_path / "store"
    ingest([corpus_dir], store, precompute_kv=False)
    before = snapshot(store)
    # the same weights under a changed config: another fingerprint
    other = tmp_path / "other-model"
    other.mkdir()
    for item in model_tokenizer.path.iterdir():
        if item.name != "config.json":
            (other / item.name).symlink_to(item)
    config = json.loads((model_tokenizer.path / "config.json").read_text())
    config["note"] = "changed"
    (other / "config.json").write_text(json.dumps(config))
    (corpus_dir / "rivers.txt").write_text("new content")
    with pytest.raises(StoreError, match="was built with model SmolLM2-135M-Instruct"):
        ingest([corpus_dir], store, model=other, precompute_kv=False)
    with pytest.raises(StoreError, match="512-token chunks, not 128"):
        ingest([corpus_dir], store, chunk_tokens=128, precompute_kv=False)
    assert snapshot(store) == before


def test_folder_that_is_not_a_store_is_refused(tmp_path, corpus_dir, embedder):
    store = tmp_path / "precious"
    store.mkdir()
    (store / "thesis.txt").write_text("do not touch")
    with pytest.raises(StoreError, match="neither an empty folder nor a cacheblend-rag store"):
        ingest([corpus_dir], store, precompute_kv=False)
    assert [p.name for p in store.iterdir()] == ["thesis.txt"]
    with pytest.raises(StoreError, match="not a cacheblend-rag store"):
        Corpus.open(store)


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_index_types_and_switching(tmp_path, corpus_dir, embedder, kind):
    store = tmp_path / "store"
    ingest([corpus_dir], store, index_type=kind, precompute_kv=False)
    with Corpus.open(store) as corpus:
        assert corpus.manifest.index_type == kind
        assert "Danube" in corpus.search("Which river flows into the Black Sea?", top_k=1)[0].text
    summary = ingest([corpus_dir], store, index_type="flat", precompute_kv=False)
    assert summary.files_changed == 0
    with Corpus.open(store) as corpus:
        assert corpus.manifest.index_type == "flat"
        assert type(corpus.sync_index()).__name__ == "IndexIDMap2"
        assert "Lessing" in corpus.search("Who wrote Emilia Galotti?", top_k=1)[0].text
    with pytest.raises(ValueError, match="unknown index type"):
        ingest([corpus_dir], store, index_type="annoy", precompute_kv=False)


def test_stale_or_missing_index_is_rebuilt(tmp_path, corpus_dir, embedder):
    store = tmp_path / "store"
    ingest([corpus_dir], store, precompute_kv=False)
    (store / FAISS_INDEX_NAME).unlink()
    with Corpus.open(store) as corpus:
        assert "Danube" in corpus.search("Black Sea river", top_k=1)[0].text
    assert (store / FAISS_INDEX_NAME).exists()
    # an index older than the chunk table (crash between commit and index write)
    with sqlite3.connect(store / DB_NAME) as db:
        db.execute("UPDATE meta SET value = '0' WHERE key = 'index_version'")
    with Corpus.open(store) as corpus:
        assert corpus.stats().index_size == 2
    with sqlite3.connect(store / DB_NAME) as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'index_version'").fetchone()[0] != "0"


CRASH_SCRIPT = """
import os, signal, sys
from cacheblend_rag.ingest.pipeline import ingest

def die_midway(stage, done, total):
    # the third file's chunks are embedded but not committed: die as a killed process would
    if stage == "embed" and done >= 3:
        os.kill(os.getpid(), signal.SIGKILL)

ingest([sys.argv[1]], sys.argv[2], precompute_kv=False, progress=die_midway)
"""


def test_kill_9_during_ingest_leaves_a_consistent_resumable_store(tmp_path, embedder):
    docs = tmp_path / "many"
    docs.mkdir()
    for i in range(8):
        (docs / f"doc{i:02d}.txt").write_text(
            f"Document {i}. " + RIVERS * (1 + i % 3) + f"Closing line {i}.\n"
        )
    store = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(docs), str(store)], capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]

    with Corpus.open(store) as corpus:
        with sqlite3.connect(store / DB_NAME) as db:
            files = db.execute("SELECT COUNT(*) FROM files").fetchone()[0]
            empty_files = db.execute(
                "SELECT COUNT(*) FROM files f "
                "WHERE NOT EXISTS (SELECT 1 FROM documents d WHERE d.file_id = f.id)"
            ).fetchone()[0]
            dangling = db.execute(
                "SELECT COUNT(*) FROM doc_chunks dc "
                "WHERE NOT EXISTS (SELECT 1 FROM chunks c WHERE c.id = dc.chunk_row)"
            ).fetchone()[0]
        assert (files, empty_files, dangling) == (2, 0, 0)  # two files committed, the third rolled back
        stats = corpus.stats()
        assert stats.chunks == 2 and stats.index_size == 2  # the index is rebuilt to match the commits

    summary = ingest([docs], store, precompute_kv=False)
    assert (summary.files_unchanged, summary.files_changed) == (2, 6)
    with Corpus.open(store) as corpus:
        assert corpus.stats().files == 8
        assert corpus.find_by_text((docs / "doc07.txt").read_text()) is not None
