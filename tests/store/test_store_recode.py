"""``cacheblend-rag store recode``: a corpus's chunk KV converted to another codec in place, a kill -9
mid-way leaving every chunk readable in one codec or the other, and a resumed run finishing the job."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import cacheblend_rag
from cacheblend_rag.cli import app
from cacheblend_rag.config import DEFAULT_KV_DTYPE, DEFAULTS
from cacheblend_rag.corpus.chunkdb import DB_NAME, ChunkDB
from cacheblend_rag.corpus.corpus import Corpus
from cacheblend_rag.corpus.manifest import CorpusManifest
from cacheblend_rag.engine import Engine
from cacheblend_rag.errors import CorruptKVError
from cacheblend_rag.store.kvstore import KVStore, tier_of

EXAMPLES = Path(__file__).parents[2] / "examples" / "data" / "corpus"
SUPPORT = Path(__file__).with_name("store_support.py")
runner = CliRunner()


@pytest.fixture(scope="module")
def float16_corpus(tmp_path_factory, model, embedder) -> Path:
    """One sample file ingested in 128-token chunks with their KV in float16."""
    from cacheblend_rag.ingest.pipeline import ingest

    corpus = tmp_path_factory.mktemp("recode") / "corpus"
    float16 = DEFAULTS.model_copy(update={"kv_dtype": "float16"})  # the default is int8
    ingest([EXAMPLES / "musique_case013.txt"], corpus, chunk_tokens=128, config=float16)
    return corpus


@pytest.fixture
def corpus(tmp_path, float16_corpus) -> Path:
    import shutil

    copy = tmp_path / "corpus"
    shutil.copytree(float16_corpus, copy)
    return copy


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def rows(corpus: Path):
    db = ChunkDB(corpus / DB_NAME)
    try:
        return db.kv_rows()
    finally:
        db.close()


def readable_in(store: KVStore, key: str) -> bool:
    source = store.get(key)
    if source is None:
        return False
    try:
        for i in range(source.num_layers):
            source.layer(i)
    except CorruptKVError:
        return False
    return True


def test_a_float16_corpus_made_before_codecs_still_hits(corpus, model):
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert manifest.pop("kv_dtype") == "float16"  # what a corpus records now
    (corpus / "manifest.json").write_text(json.dumps(manifest))  # as one made before codecs were recorded
    assert CorpusManifest.load(corpus).kv_dtype == ""
    assert DEFAULT_KV_DTYPE != "float16"  # the default changed since: the corpus still reads its own codec
    with Corpus.open(corpus) as opened:
        assert opened.kv_dtype == "float16"
        for _, token_ids, key, _ in rows(corpus):
            assert opened.chunk_key(token_ids) == key
    engine = Engine(model, corpus / "kv", kv_dtype=None)
    for _, token_ids, key, ready in rows(corpus):
        assert ready and engine.chunk_key(token_ids) == key  # same keys as before: nothing recomputed
    source = engine.chunk_kv(rows(corpus)[0][1])
    assert tier_of(source) in ("disk", "ram") and engine.store.counters.puts == 0
    engine.close()


def test_recode_converts_in_place_and_stats_show_the_codec(corpus):
    before = rows(corpus)
    result = invoke("store", "recode", "--kv-dtype", "int8", "--corpus", corpus, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # progress lines go to stderr
    assert report["converted"] == len(before) and report["old_files_removed"] == len(before)
    assert f"recode (chunks): {len(before)}/{len(before)} (100%)" in result.stderr
    assert report["new_bytes"] <= 0.55 * report["old_bytes"]  # 128-token chunks: a whole key group each
    manifest = CorpusManifest.load(corpus)
    assert (manifest.kv_dtype, manifest.format_version) == ("int8", 3)  # a build before codecs refuses it
    stats = json.loads(invoke("store", "stats", "--corpus", corpus, "--json").output)
    assert stats["kv_dtype"] == "int8" and list(stats["disk"]["by_codec"]) == ["int8"]
    assert stats["disk"]["by_codec"]["int8"]["entries"] == len(before)
    store = KVStore.open_existing(corpus / "kv", kv_dtype="int8")
    for (_, token_ids, old_key, _), (_, _, new_key, ready) in zip(before, rows(corpus), strict=True):
        assert (
            ready
            and new_key != old_key
            and new_key == store.chunk_key(token_ids, new_key and store_context(corpus))
        )
        assert readable_in(store, new_key)
    store.close()
    assert invoke("store", "verify", "--corpus", corpus).exit_code == 0
    again = json.loads(invoke("store", "recode", "--kv-dtype", "int8", "--corpus", corpus, "--json").stdout)
    assert again["converted"] == 0
    back = invoke("store", "recode", "--kv-dtype", "float16", "--corpus", corpus)
    assert back.exit_code == 1 and "re-ingest" in back.output  # int8's values under float16's keys
    assert (CorpusManifest.load(corpus).kv_dtype, CorpusManifest.load(corpus).format_version) == ("int8", 3)


def snapshot(corpus: Path, client) -> dict:
    """Every byte a recode could change: each file of the corpus, and each value on the Redis server."""
    files = {str(p.relative_to(corpus)): p.read_bytes() for p in sorted(corpus.rglob("*")) if p.is_file()}
    return {"files": files, "remote": {name: client.dump(name) for name in client.keys("*")}}


def test_recode_to_a_finer_codec_is_refused_and_changes_nothing(corpus, redis_server):
    client = redis_server.client()
    remote = ("--kv-remote", redis_server.url)
    assert invoke("store", "recode", "--kv-dtype", "int8", "--corpus", corpus).exit_code == 0
    coarser = invoke("store", "recode", "--kv-dtype", "int4", "--corpus", corpus, *remote, "--json")
    assert coarser.exit_code == 0, coarser.output
    assert json.loads(coarser.stdout)["converted"] == len(rows(corpus))
    before = snapshot(corpus, client)
    stored = [name for name in before["remote"] if client.type(name) == b"hash"]
    assert len(stored) == len(rows(corpus)), before["remote"].keys()  # the int4 KV is in both tiers

    refused = invoke("store", "recode", "--kv-dtype", "int8", "--corpus", corpus, *remote)
    assert refused.exit_code == 1
    message = " ".join(refused.output.split())
    assert "from int4 to int8" in message and "re-ingest" in message, refused.output
    assert snapshot(corpus, client) == before  # no file, key or remote value touched
    assert CorpusManifest.load(corpus).kv_dtype == "int4"
    verify = invoke("store", "verify", "--corpus", corpus, *remote, "--json")
    assert verify.exit_code == 0 and json.loads(verify.output)["clean"], verify.output


def store_context(corpus: Path) -> str:
    from cacheblend_rag.blend.segments import ChunkContext

    return ChunkContext(CorpusManifest.load(corpus).chunk_context).key


def test_recode_killed_mid_way_leaves_every_chunk_readable_and_a_rerun_finishes(tmp_path, corpus):
    import subprocess

    sync = tmp_path / "sync"
    sync.mkdir()
    before = rows(corpus)
    # the child imports the code under test, as this process does
    root = str(Path(cacheblend_rag.__file__).parents[1])
    env = {
        **os.environ,
        "CACHEBLEND_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    }
    child = subprocess.Popen(
        [sys.executable, str(SUPPORT), "recode-and-stall", str(corpus), str(sync), "int4", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 600
        while not (sync / "stalled").exists():
            assert child.poll() is None, (
                f"the child exited with {child.returncode}: {child.stderr.read()[-3000:]}"
            )
            assert time.monotonic() < deadline, "the child did not reach its stall point"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert CorpusManifest.load(corpus).kv_dtype == "float16"  # not flipped yet
    context = store_context(corpus)
    old = KVStore.open_existing(corpus / "kv", kv_dtype="float16")
    new = KVStore(corpus / "kv", old.fingerprint, old.shape, "int4")
    in_new = 0
    for _, token_ids, _, _ in before:
        in_old = readable_in(old, old.chunk_key(token_ids, context))
        in_new += readable_in(new, new.chunk_key(token_ids, context))
        assert in_old  # the corpus still reads every chunk in its codec
    assert in_new == 3
    old.close()
    new.close()
    assert invoke("store", "verify", "--corpus", corpus).exit_code == 1  # the killed writer's temp file

    result = invoke("store", "recode", "--kv-dtype", "int4", "--corpus", corpus, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["already_done"] == 3 and report["converted"] == len(before) - 3
    assert CorpusManifest.load(corpus).kv_dtype == "int4"
    verify = invoke("store", "verify", "--corpus", corpus, "--json")
    assert verify.exit_code == 0 and json.loads(verify.output)["clean"], verify.output
    stats = json.loads(invoke("store", "stats", "--corpus", corpus, "--json").output)
    assert list(stats["disk"]["by_codec"]) == ["int4"]
