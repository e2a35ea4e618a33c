"""The remote KV tier wired through the product, on a real Redis server: ``contains`` and ``pin``, ingest
pinning the corpus (and computing nothing a tier already holds), and ``store stats|verify|gc`` with
``--kv-remote``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from redis_support import forge_layer_bytes
from typer.testing import CliRunner

from cacheblend_rag.cli import app
from cacheblend_rag.engine import Engine, SamplingParams
from cacheblend_rag.ingest.pipeline import ingest
from cacheblend_rag.rag import CacheBlendRAG
from cacheblend_rag.settings import get_settings
from cacheblend_rag.store.kvstore import KVStore

DATA_DIR = Path(__file__).parents[1] / "data"
CHUNK_TOKENS = 128
SAMPLING = SamplingParams(max_tokens=8)
runner = CliRunner()


def pinned_keys(redis_server) -> dict[bytes, int]:
    """Every value under the tier's prefix and its TTL (-1: pinned)."""
    client = redis_server.client()
    return {name: client.ttl(name) for name in client.scan_iter(match="cacheblend:kv:*")}


def node(model, root: Path, remote: str) -> Engine:
    return Engine(model, store=KVStore(root, model.fingerprint, model.shape, "float16", remote=remote))


@pytest.fixture
def docs(tmp_path) -> Path:
    """Three real paragraphs (MuSiQue case 0) in one text file: a few 128-token chunks."""
    case = json.loads((DATA_DIR / "musique_case0.json").read_text())
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "case0.txt").write_text("\n\n".join(case["paragraphs"][:3]) + "\n")
    return folder


def test_contains_consults_the_remote_tier_and_pin_publishes_local_chunks(
    tmp_path, redis_server, model, real_chunks
):
    (ids, kv), (ids_b, kv_b) = real_chunks
    local = KVStore(tmp_path / "l", model.fingerprint, model.shape, "float16", remote="")
    key = local.chunk_key(ids)
    local.put(key, kv)  # stored before the node had a remote tier
    local.close()
    node_l = KVStore(tmp_path / "l", model.fingerprint, model.shape, "float16", remote=redis_server.url)
    other = KVStore(tmp_path / "o", model.fingerprint, model.shape, "float16", remote=redis_server.url)
    assert node_l.contains(key) and not other.contains(key)  # only node L's disk holds it

    assert node_l.pin(key)  # pushed from L's disk, as corpus KV
    assert pinned_keys(redis_server) == {other.remote.name_for(key).encode(): -1}
    assert other.contains(key) and not other.contains(key, remote=False)

    key_b = other.chunk_key(ids_b)
    other.put(key_b, kv_b, pinned=False)  # request traffic: a TTL on the server
    assert redis_server.client().ttl(other.remote.name_for(key_b)) > 0
    assert node_l.pin(key_b) and redis_server.client().ttl(other.remote.name_for(key_b)) == -1
    assert not node_l.pin(other.chunk_key([1, 2, 3]))  # no tier holds it: nothing to pin
    for store in (node_l, other):
        store.close()


def test_ingest_pins_the_corpus_and_a_node_ingesting_it_again_computes_nothing(
    tmp_path, redis_server, model, docs, embedder, cli
):
    node_a = node(model, tmp_path / "a" / "kv", redis_server.url)
    summary_a = ingest([docs], tmp_path / "a", chunk_tokens=CHUNK_TOKENS, engine=node_a)
    chunks = summary_a.new_chunks  # distinct chunks (the paragraphs share some)
    assert chunks >= 3 and summary_a.kv_chunks == chunks and summary_a.kv_remote_pinned == chunks
    assert sorted(pinned_keys(redis_server).values()) == [-1] * chunks  # every chunk pinned, none ad hoc

    # node B ingests the same files: every chunk's KV is on the tier, so none is computed
    node_b = node(model, tmp_path / "b" / "kv", redis_server.url)
    summary_b = ingest([docs], tmp_path / "b", chunk_tokens=CHUNK_TOKENS, engine=node_b)
    assert (summary_b.kv_chunks, summary_b.kv_bytes, summary_b.kv_remote_pinned) == (0, 0, chunks)
    assert node_b.store.stats()["disk"]["entries"] == 0 and node_b.store.counters.puts == 0
    question = json.loads((DATA_DIR / "musique_case0.json").read_text())["question"]
    answers = [
        CacheBlendRAG(root, engine=engine).query(question, top_k=2, sampling=SAMPLING)
        for root, engine in ((tmp_path / "a", node_a), (tmp_path / "b", node_b))
    ]
    assert answers[0].answer == answers[1].answer and answers[1].reused_tokens > 0
    remote_b = node_b.store.remote.counters
    assert remote_b.hits >= 2 and remote_b.misses == 0 and remote_b.puts == 0  # read through, none computed

    # `query --kv-remote` on a node with the corpus files only: read through (a chunk it computed would be
    # written back to the tier with a TTL), the same answer
    shutil.copytree(tmp_path / "a", tmp_path / "d", ignore=shutil.ignore_patterns("kv", "*-shm", "*.lock"))
    url = redis_server.url
    code, out = cli(
        "query",
        "--corpus",
        tmp_path / "d",
        "--kv-remote",
        url,
        "--json",
        "--top-k",
        2,
        "--max-tokens",
        8,
        question,
    )
    assert (
        code == 0 and json.loads(out)["answer"] == answers[0].answer and json.loads(out)["reused_tokens"] > 0
    )
    assert sorted(pinned_keys(redis_server).values()) == [-1] * chunks
    assert len(list((tmp_path / "d" / "kv" / "chunks").rglob("*.safetensors"))) == 2  # kept locally

    # a store ingested before the tier existed is published by running ingest again with the tier
    node_c = node(model, tmp_path / "c" / "kv", "")
    ingest([docs], tmp_path / "c", chunk_tokens=CHUNK_TOKENS, engine=node_c)
    node_c.store.close()
    redis_server.client().flushall()
    node_c = node(model, tmp_path / "c" / "kv", redis_server.url)
    summary_c = ingest([docs], tmp_path / "c", chunk_tokens=CHUNK_TOKENS, engine=node_c)
    assert (summary_c.files_unchanged, summary_c.kv_chunks, summary_c.kv_remote_pinned) == (1, 0, chunks)
    assert sorted(pinned_keys(redis_server).values()) == [-1] * chunks
    for engine in (node_a, node_b, node_c):
        engine.store.close()


@pytest.fixture
def cli(monkeypatch):
    """``cli(ARGS...) -> (exit code, output)`` in this process, with no remote tier from the caller's
    environment; ``--kv-remote`` overrides the setting for its command only."""
    monkeypatch.delenv("CACHEBLEND_KV_REMOTE", raising=False)  # a URL from the caller's environment
    get_settings.cache_clear()
    yield _invoke


def _invoke(*args) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout


def test_store_commands_cover_the_remote_tier(tmp_path, redis_server, model, real_chunks, cli):
    corpus_dir = tmp_path / "store"
    store = KVStore(corpus_dir / "kv", model.fingerprint, model.shape, "float16", remote=redis_server.url)
    keys = [store.chunk_key(ids) for ids, _ in real_chunks]
    store.put(keys[0], real_chunks[0][1])  # pinned corpus
    store.put(keys[1], real_chunks[1][1], pinned=False)  # request traffic
    tier = store.remote
    url = redis_server.url

    code, out = cli("store", "stats", "--corpus", corpus_dir, "--kv-remote", url, "--json")
    remote = json.loads(out)["remote"]
    assert (
        code == 0
        and remote["available"]
        and (remote["entries"], remote["pinned"], remote["adhoc"]) == (2, 1, 1)
    )
    assert remote["bytes"] == sum(kv.to(store.kv_dtype).nbytes for _, kv in real_chunks)
    code, out = cli("store", "stats", "--corpus", corpus_dir, "--kv-remote", url)
    assert code == 0 and "remote" in out and "2 (1 pinned)" in out

    code, out = cli("store", "verify", "--corpus", corpus_dir, "--kv-remote", url, "--json")
    report = json.loads(out)
    assert code == 0 and report["clean"] and report["remote"]["ok"] == 2 and report["remote"]["pinned"] == 1

    client = redis_server.client()
    forge_layer_bytes(client, tier.name_for(keys[0]), {})
    client.set(f"{tier.prefix}:not-a-chunk", b"junk")
    code, out = cli("store", "verify", "--corpus", corpus_dir, "--kv-remote", url, "--json")
    report = json.loads(out)
    assert code == 1 and not report["clean"] and report["ok"] == 2  # the local files are fine
    assert [bad["key"] for bad in report["remote"]["corrupt"]] == [keys[0]]
    assert report["remote"]["stray_keys"] == [f"{tier.prefix}:not-a-chunk"]
    assert "layer 3 checksum mismatch" in report["remote"]["corrupt"][0]["reason"]
    code, out = cli("store", "verify", "--corpus", corpus_dir, "--kv-remote", url)
    assert code == 1 and "corrupt remote" in out and "--repair" in out

    client.set(f"{tier.prefix}:another-stray", b"junk")
    code, out = cli("store", "gc", "--corpus", corpus_dir, "--kv-remote", url, "--json")
    assert code == 0 and json.loads(out)["remote_stray_removed"] == 2
    code, out = cli("store", "verify", "--corpus", corpus_dir, "--kv-remote", url, "--repair", "--json")
    assert code == 0 and json.loads(out)["remote"]["repaired"]
    code, out = cli("store", "verify", "--corpus", corpus_dir, "--kv-remote", url, "--json")
    assert code == 0 and json.loads(out)["remote"]["checked"] == 1  # the forged value was deleted
    assert list(pinned_keys(redis_server)) == [tier.name_for(keys[1]).encode()]

    code, out = cli("store", "stats", "--corpus", corpus_dir, "--kv-remote", "http://127.0.0.1:1")
    assert code == 1 and "redis://HOST:PORT/DB" in out
    store.close()
