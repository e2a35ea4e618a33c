"""Two nodes, one shared Redis: node A ingests (pinning every chunk in Redis), node B has the same corpus
metadata and an empty local KV directory, and answers from A's chunk KV without computing any; when Redis
dies mid-run, B keeps answering (recomputing, with one warning) and neither local store is damaged."""

from __future__ import annotations

import shutil
from pathlib import Path

import openai
import pytest
from serve_support import rag_messages, run_cli, server_process

from cacheblend_rag.corpus.corpus import Corpus

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).parents[2] / "examples" / "data"
CHUNK_TOKENS = 128
MAX_TOKENS = 10
QUESTIONS = ["Who wrote it?", "When did it premiere?", "Where was it set?"]
OUTAGE_WARNING = "is unavailable"


@pytest.fixture
def docs(tmp_path) -> Path:
    """An excerpt of the sample corpus (CC BY 4.0): a dozen 128-token chunks."""
    folder = tmp_path / "docs"
    folder.mkdir()
    text = (EXAMPLES / "corpus" / "musique_case005.md").read_text()
    (folder / "lessing.md").write_text(text[:6000] + "\n")
    return folder


def ask(client: openai.OpenAI, model: str, texts: list[str], question: str):
    messages = rag_messages(texts, question)
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )


def remote_counters(node) -> dict:
    return node.health()["kv_store"]["remote"]["counters"]


def test_node_b_answers_from_node_a_chunks_and_survives_redis_dying(tmp_path, redis_server, docs):
    url = redis_server.url
    node_a_dir, node_b_dir = tmp_path / "a", tmp_path / "b"
    done = run_cli("ingest", docs, "--corpus", node_a_dir, "--chunk-tokens", CHUNK_TOKENS, "--kv-remote", url)
    assert done.returncode == 0, done.stderr[-3000:]
    with Corpus.open(node_a_dir) as corpus:
        chunks = corpus.get_chunks(list(corpus.db.iter_chunk_ids()))
    client = redis_server.client()
    names = list(client.scan_iter(match="cacheblend:kv:*"))
    assert len(names) == len(chunks) >= 6 and all(client.ttl(name) == -1 for name in names)  # all pinned
    assert f"{len(chunks)} chunks pinned" in done.stdout

    # node B: A's corpus metadata (documents, chunks, vector index), nothing in its local KV directory
    shutil.copytree(node_a_dir, node_b_dir, ignore=shutil.ignore_patterns("kv", "*-shm", "*.lock"))
    logs = tmp_path / "logs"
    nodes = [server_process(d, logs / f"{d.name}.log", "--kv-remote", url) for d in (node_a_dir, node_b_dir)]
    node_a, node_b = (node.spawn() for node in nodes)
    try:
        node_a.wait_ready()
        node_b.wait_ready()
        assert node_b.health()["kv_store"]["disk"]["entries"] == 0
        model = node_a.health()["model"]
        clients = [openai.OpenAI(base_url=n.url, api_key="unused", max_retries=0) for n in (node_a, node_b)]
        prompts = [
            ([c.text for c in chunks[i : i + 2]], q) for i, q in zip((0, 2, 4), QUESTIONS, strict=True)
        ]

        for texts, question in prompts[:2]:
            from_a, from_b = (ask(c, model, texts, question) for c in clients)
            assert from_b.choices[0].message.content == from_a.choices[0].message.content
            assert (
                from_b.usage.prompt_tokens_details.cached_tokens
                == from_a.usage.prompt_tokens_details.cached_tokens
                > 0
            )
        counters = remote_counters(node_b)
        # every chunk came from Redis: no miss, so no chunk was computed on B, and nothing written back
        assert (counters["hits"], counters["misses"], counters["corrupt"], counters["puts"]) == (4, 0, 0, 0)
        assert counters["layer_reads"] > 0

        redis_server.kill()
        texts, question = prompts[2]
        from_a, from_b = (ask(c, model, texts, question) for c in clients)  # chunks B has never seen
        assert from_b.choices[0].message.content == from_a.choices[0].message.content
        # computed on B for this request: not read from any cache, and not reported as cached
        blend_b = from_b.model_extra["cacheblend"]
        assert blend_b["cache_read_blended_tokens"] == 0 and blend_b["kv_computed_tokens"] > 0
        assert from_b.usage.prompt_tokens_details.cached_tokens == blend_b["cache_read_exact_tokens"]
        again = ask(clients[1], model, *prompts[0])  # from B's own tiers now
        assert from_b.choices and again.usage.prompt_tokens_details.cached_tokens > 0
        remote = node_b.health()["kv_store"]["remote"]
        assert not remote["available"] and remote["counters"]["outages"] == 1
    finally:
        codes = [node.stop() for node in nodes]
    assert codes == [0, 0]
    warnings = [line for line in nodes[1].log_text().splitlines() if OUTAGE_WARNING in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0], warnings  # one warning for the whole outage

    for store in (node_a_dir, node_b_dir):  # nothing in either local store is damaged
        verified = run_cli("store", "verify", "--corpus", store)
        assert verified.returncode == 0, verified.stdout
    assert (
        "0 corrupt" in verified.stdout and "checked 6 files" in verified.stdout
    )  # B: 4 read through + 2 computed
