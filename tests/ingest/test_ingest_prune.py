"""Re-ingesting a folder forgets the files deleted from it: their documents, chunk rows, vectors and KV
(the real pipeline, with chunk KV precomputed by the real engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cacheblend_rag.corpus.corpus import Corpus
from cacheblend_rag.ingest.pipeline import ingest
from cacheblend_rag.store.kvstore import KVStore

pytestmark = pytest.mark.slow

CORPUS = Path(__file__).parents[2] / "examples" / "data" / "corpus"


def write_files(folder: Path) -> None:
    """Three small files cut from the sample corpus (a few chunks each, so KV precompute stays quick)."""
    folder.mkdir(parents=True)
    text = (CORPUS / "musique_case013.txt").read_text(encoding="utf-8")
    paragraphs = [p for p in text.split("\n") if p.strip()]
    third = len(paragraphs) // 3
    assert third >= 1
    for i, name in enumerate(("one.txt", "two.txt", "three.md")):
        (folder / name).write_text("\n".join(paragraphs[i * third : (i + 1) * third]), encoding="utf-8")


def kv_keys(corpus_dir: Path) -> set[str]:
    with Corpus.open(corpus_dir) as corpus:
        rows = corpus.db.chunks_by_ids(list(corpus.db.iter_chunk_ids()))
        assert corpus.sync_index().ntotal == len(rows) == corpus.db.counts()["kv_ready"]
        return {row.kv_key for row in rows.values()}


def test_reingest_prunes_files_deleted_from_the_folder(tmp_path):
    docs, other, store = tmp_path / "docs", tmp_path / "other", tmp_path / "store"
    write_files(docs)
    other.mkdir()
    (other / "kept.txt").write_text("A file from another folder of the same corpus, never pruned by docs.")
    ingest([docs], store)
    ingest([other], store)
    before = kv_keys(store)

    (docs / "two.txt").unlink()
    summary = ingest([docs], store)
    assert (summary.removed_files, summary.files_changed) == (1, 0)
    assert summary.removed_chunks > 0
    after = kv_keys(store)
    removed = before - after
    assert len(removed) == summary.removed_chunks and after < before
    with Corpus.open(store) as corpus:
        paths = corpus.db.file_paths()
        assert not any(p.endswith("two.txt") for p in paths)
        assert any(p.endswith("kept.txt") for p in paths)  # another folder: untouched
    kv = KVStore.open_existing(store / "kv")
    try:
        assert not any(kv.contains(key, remote=False) for key in removed)
        assert all(kv.contains(key, remote=False) for key in after)
        assert kv.stats()["disk"]["entries"] == len(after)
        assert kv.verify().clean
    finally:
        kv.close()
    assert ingest([docs], store).removed_files == 0  # nothing more to prune
