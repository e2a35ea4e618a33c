"""The batch scheduler: batched answers equal one-at-a-time ones, a shared chunk is read from disk once per
batch, admission keeps to the KV budget in FIFO order, every request streams its own tokens, and
``query --batch`` answers a file of questions like ``query`` answers each."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from cacheblend_rag.cli import app
from cacheblend_rag.engine import Engine, SamplingParams
from cacheblend_rag.engine.scheduler import BatchScheduler, GenerationRequest
from cacheblend_rag.errors import AdmissionError, FusionInputError, SchedulerClosedError
from cacheblend_rag.eval.bench.prompts import overlapping_musique_requests
from cacheblend_rag.store.keys import kv_bytes_per_token
from cacheblend_rag.store.kvstore import KVStore

DATA_DIR = Path(__file__).parent.parent / "data"
SAMPLING = SamplingParams(max_tokens=16)
# mixed methods in one batch; cacheblend, the one that shares chunks, most of all
METHODS = ["cacheblend", "full_recompute", "cacheblend", "prefix_cache", "cacheblend", "cacheblend"]


@pytest.fixture(scope="module")
def disk_engine(model, tmp_path_factory):
    # No RAM tier: every read comes from disk and nothing is promoted, so only the scheduler's sharing can
    # keep a chunk that several requests use from being read once per request.
    store = KVStore(
        tmp_path_factory.mktemp("sched") / "kv", model.fingerprint, model.shape, ram_budget_bytes=0
    )
    yield Engine(model, store=store)
    store.close()


@pytest.fixture(scope="module")
def batched_run(disk_engine, model):
    """Six MuSiQue requests (4 chunks of 120 tokens each, neighbours sharing 2 chunks) answered one at a
    time, then all together through the scheduler while a thread per request consumes its stream."""
    engine = disk_engine
    cases = json.loads((DATA_DIR / "musique_24.json").read_text())
    questions = overlapping_musique_requests(
        cases[:7], model.tokenizer, 6, chunks_per_request=4, chunk_tokens=120
    )

    def build():
        return [engine.rag_segments(q.question, q.refs, m) for q, m in zip(questions, METHODS, strict=True)]

    build()  # computes and stores every chunk's (and the prefix's) KV
    engine.store.reset_counters()
    sequential = [engine.generate(s, m, SAMPLING) for s, m in zip(build(), METHODS, strict=True)]
    sequential_reads = Counter(engine.store.counters.disk_layer_reads)

    segments = build()
    engine.store.reset_counters()
    streams: list[list[tuple[str, bool]]] = [[] for _ in segments]

    def consume(handle, out):
        for event in handle:
            out.append((event.text, handle.done()))

    with BatchScheduler(engine, max_batch=8) as scheduler:
        handles = scheduler.submit_many(
            [GenerationRequest.of(s, m, SAMPLING) for s, m in zip(segments, METHODS, strict=True)]
        )
        threads = [
            threading.Thread(target=consume, args=(h, out)) for h, out in zip(handles, streams, strict=True)
        ]
        for thread in threads:
            thread.start()
        results = [handle.result(timeout=1800) for handle in handles]
        for thread in threads:
            thread.join()
    return SimpleNamespace(
        sequential=sequential,
        sequential_reads=sequential_reads,
        results=results,
        handles=handles,
        streams=streams,
        segments=segments,
        counters=engine.store.counters,
        stats=scheduler.stats,
    )


def test_batched_greedy_answers_equal_one_at_a_time(batched_run):
    for one, batched in zip(batched_run.sequential, batched_run.results, strict=True):
        assert batched.token_ids == one.token_ids
        assert batched.text == one.text and batched.finish_reason == one.finish_reason
        assert (batched.method, batched.reused_tokens, batched.computed_tokens) == (
            one.method,
            one.reused_tokens,
            one.computed_tokens,
        )
    stats = batched_run.stats
    assert stats.groups == 1 and stats.max_rows == len(METHODS)
    assert stats.fusion_passes == 1  # the group's prompts were fused together
    # one forward per step for all rows, not one per row
    assert stats.decode_steps < SAMPLING.max_tokens
    assert stats.decode_rows > 3 * stats.decode_steps
    assert all(len(r.token_ids) > 1 for r in batched_run.results)


def test_each_shared_chunk_is_read_from_disk_once_per_batch(batched_run, disk_engine, model):
    def key(segment, method):  # prefix_cache reuses the prompt's own head: KV prefilled alone, no context
        if method == "prefix_cache":
            return disk_engine.store.chunk_key(segment.token_ids)
        return disk_engine.chunk_key(segment.token_ids)

    # exact template heads live in the engine's memory, never on disk
    users = Counter(
        key(s, method)
        for segs, method in zip(batched_run.segments, METHODS, strict=True)
        for s in segs
        if s.is_cached and not s.exact
    )
    assert max(users.values()) >= 2  # the requests do share chunks
    layers = model.num_layers
    assert batched_run.counters.disk_layer_reads == {key: layers for key in users}
    assert batched_run.counters.ram_hits == 0
    # one at a time, the same requests read each shared chunk once per request
    assert batched_run.sequential_reads == {key: n * layers for key, n in users.items()}


def test_each_request_streams_its_own_tokens(batched_run):
    for stream, result, handle in zip(
        batched_run.streams, batched_run.results, batched_run.handles, strict=True
    ):
        assert "".join(text for text, _ in stream) == result.text
        assert len(stream) > 1
        assert not stream[0][1]  # the first piece arrived while the request was still generating
        assert 0 < result.ttft_s < result.total_s
        assert handle.first_token_at < handle.finished_at


def _chat(engine: Engine, text: str):
    return engine.chat_segments([{"role": "user", "content": text}])


def test_admission_keeps_to_the_budget_in_fifo_order(disk_engine, musique_case):
    engine = disk_engine
    params = SamplingParams(max_tokens=4)
    small = [_chat(engine, q) for q in ("Say hi.", "Name a colour.", "Name a fruit.")]
    big = _chat(engine, "Summarise: " + musique_case["paragraphs"][0][:900])
    caps = [sum(len(s) for s in segs) + params.max_tokens for segs in (*small, big)]
    assert 2 * max(caps[:3]) <= caps[3]  # two small rows fit where one big one does
    budget = caps[3] * kv_bytes_per_token(engine.model.shape, engine.model.dtype)  # big alone, or 2 small
    with BatchScheduler(engine, max_batch=8, kv_budget_bytes=budget) as scheduler:
        order = [small[0], big, small[1], small[2]]
        handles = scheduler.submit_many([GenerationRequest.of(s, "full_recompute", params) for s in order])
        results = [h.result(timeout=600) for h in handles]
        with pytest.raises(AdmissionError, match="budget"):
            scheduler.submit(GenerationRequest.of(big, "full_recompute", SamplingParams(max_tokens=64)))
    # the big request cannot join the first small one, and the small ones behind it do not overtake it
    assert [h.group for h in handles] == [1, 2, 3, 3]
    assert scheduler.stats.max_rows == 2
    assert 0 < scheduler.stats.peak_kv_bytes <= budget
    for segments, result in zip(order, results, strict=True):
        assert result.token_ids == engine.generate(segments, "full_recompute", params).token_ids
    with pytest.raises(SchedulerClosedError, match="closed"):  # typed: a server answers it as draining
        scheduler.submit(GenerationRequest.of(small[0], "full_recompute", params))


def test_submit_from_many_threads(disk_engine):
    engine = disk_engine
    params = SamplingParams(max_tokens=5)
    prompts = [_chat(engine, f"Give a word that rhymes with {w}.") for w in ("cat", "tree", "light", "rain")]
    results: dict[int, list[int]] = {}
    with BatchScheduler(engine) as scheduler:

        def client(i: int) -> None:
            results[i] = (
                scheduler.submit(GenerationRequest.of(prompts[i], "full_recompute", params))
                .result(timeout=600)
                .token_ids
            )

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert scheduler.stats.completed == len(prompts) and scheduler.stats.failed == 0
    for i, segments in enumerate(prompts):
        assert results[i] == engine.generate(segments, "full_recompute", params).token_ids


def test_bad_requests_are_refused_at_submit(disk_engine):
    with BatchScheduler(disk_engine) as scheduler:
        segments = _chat(disk_engine, "Say hi.")
        with pytest.raises(ValueError, match="unknown method"):
            scheduler.submit(GenerationRequest.of(segments, "no_such_method"))
        with pytest.raises(FusionInputError, match="no tokens"):
            scheduler.submit(GenerationRequest.of([], "full_recompute"))
        assert scheduler.stats.submitted == 0
    with pytest.raises(ValueError, match="max_batch"):
        BatchScheduler(disk_engine, max_batch=0)


def _run_cli(*args) -> tuple[int, str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout


def test_query_batch_answers_like_single_queries(tmp_path, musique_case, embedder):
    from cacheblend_rag.ingest.pipeline import ingest

    docs = tmp_path / "docs"
    docs.mkdir()
    for i, paragraph in enumerate(musique_case["paragraphs"][:3]):
        (docs / f"p{i}.txt").write_text(paragraph[:600])
    store = tmp_path / "store"
    ingest([docs], store, chunk_tokens=96, precompute_kv=False)
    questions = [musique_case["question"], "Which series did Bryan Fuller develop for NBC?"]
    batch = tmp_path / "questions.jsonl"
    batch.write_text("".join(json.dumps({"question": q, "id": i}) + "\n" for i, q in enumerate(questions)))
    options = ["--corpus", store, "--top-k", "2", "--max-tokens", "6"]

    code, output = _run_cli("query", "--batch", batch, *options, "--json")
    assert code == 0, output
    answers = json.loads(output)
    assert [a["question"] for a in answers] == questions
    for question, answer in zip(questions, answers, strict=True):
        code, output = _run_cli("query", question, *options, "--json")
        assert code == 0, output
        single = json.loads(output)
        assert (answer["answer"], answer["chunk_ids"]) == (single["answer"], single["chunk_ids"])

    plain = tmp_path / "questions.txt"
    plain.write_text("\n".join(questions) + "\n\n")
    code, output = _run_cli("query", "--batch", plain, *options)
    assert code == 0, output
    assert f"2. {questions[1]}" in " ".join(output.split()) and answers[1]["answer"] in output

    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "fine"}\n{"text": "no question"}\n')
    result = CliRunner().invoke(app, ["query", "--batch", str(broken), "--corpus", str(store)])
    assert result.exit_code == 1 and "broken.jsonl:2" in " ".join(result.stderr.split())
    result = CliRunner().invoke(app, ["query", "why?", "--batch", str(plain), "--corpus", str(store)])
    assert result.exit_code == 2
