"""Section ``serve``: a bounded load test of ``cacheblend-rag serve`` over loopback.

A real server process serves the sample corpus, ingested here with its chunk KV; ``c`` clients (threads,
one HTTP connection each) send streamed chat completions at once, each ``rounds`` requests back to back,
for each concurrency level and each method (the ``method`` extension field: full prefill vs CacheBlend on
the same prompts). Per (method, level): requests/s over the run, and TTFT percentiles as the client sees
them (from sending the request to the first streamed token: HTTP, prompt recognition, queueing, fusion),
beside the server's own TTFT.

The prompts are the engine's RAG prompt with each question's top-k retrieved chunks pasted in as text, as
any OpenAI client would send them; the server recognises the chunks. Every prompt is sent once per method
before timing, so every chunk's KV is stored and first-use costs stay out of the numbers. Bounded: every
request has a timeout, and the run sends ``sum(levels) * rounds`` requests per method.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ...blend.spec import parse_method
from ...corpus.corpus import Corpus
from ...engine import Engine
from ...engine.prompt import CHUNK_SEPARATOR, DEFAULT_SYSTEM_PROMPT, DEFAULT_USER_TEMPLATE
from ...ingest import ingest
from ...records import OpenRecord
from ...settings import get_settings
from ..markdown import fmt, table
from .config import BenchContext
from .ingest import copy_sample_corpus
from .page import Page
from .throughput import ThroughputRow, throughput_row

log = logging.getLogger(__name__)

SERVE_METHODS = ("full_recompute", "cacheblend")


@dataclass
class ServeLoadConfig:
    """What the load test sends. ``max_batch``: the server's batch scheduler size (default: the highest
    level, so that every client can be decoded at once); ``ratio``: the recompute ratio of methods that
    have one (None: the server's loading controller chooses)."""

    levels: tuple[int, ...] = (1, 4, 8, 16)
    methods: tuple[str, ...] = SERVE_METHODS
    rounds: int = 2
    max_tokens: int = 16
    top_k: int = 4
    ratio: float | None = None
    request_timeout_s: float = 600.0
    max_batch: int | None = None

    def __post_init__(self) -> None:
        if not self.levels or any(level < 1 for level in self.levels):
            raise ValueError(f"concurrency levels must be >= 1, got {self.levels}")
        if self.rounds < 1 or self.max_tokens < 1 or self.top_k < 1:
            raise ValueError("rounds, max_tokens and top_k must be >= 1")


@dataclass
class RequestSample:
    """One request as the client saw it (times from sending it)."""

    ttft_s: float
    latency_s: float
    tokens: int  # completion tokens
    answer: str
    cached_tokens: int
    server_ttft_s: float


@dataclass(frozen=True)
class ServeRow(ThroughputRow):
    """A throughput row (requests/s, TTFT percentiles as the clients saw them) plus the server's TTFT, the
    latency and the mean cached (recognised) prompt tokens."""

    server_ttft_p50_s: float
    latency_p50_s: float
    cached_tokens_mean: float


@dataclass(frozen=True, kw_only=True)
class ServeResult(OpenRecord):
    """The load test: what it sent, a row per method and level, and the server scheduler's counters.
    ``ratio`` None: the server chose; ``chunk_tokens`` is the bench's (the section sets it;
    :func:`run_serve_load` does not know it)."""

    levels: list[int]
    rounds: int
    max_tokens: int
    top_k: int
    ratio: float | None  # written as null when the server chose
    max_batch: int
    prompts: int
    methods: dict[str, dict[str, ServeRow]]
    speedup_cacheblend_vs_full: dict[str, float]
    scheduler: dict[str, Any]
    chunk_tokens: int | None = None


def load_summary(samples: Sequence[RequestSample], seconds: float) -> ServeRow:
    """A throughput row (requests/s, TTFT percentiles) plus the server's TTFT, latency and reuse."""
    row = throughput_row(samples, seconds)
    return ServeRow(
        **asdict(row),
        server_ttft_p50_s=float(np.percentile([s.server_ttft_s for s in samples], 50)),
        latency_p50_s=float(np.percentile([s.latency_s for s in samples], 50)),
        cached_tokens_mean=float(np.mean([s.cached_tokens for s in samples])),
    )


def rag_messages(corpus_dir: str | Path, questions: Sequence[str], top_k: int) -> list[list[dict[str, str]]]:
    """Each question with its top-k chunks pasted into the engine's RAG prompt, as chat messages."""
    with Corpus.open(corpus_dir) as corpus:
        prompts = []
        for question in questions:
            passages = CHUNK_SEPARATOR.join(c.text for c in corpus.search(question, top_k))
            content = DEFAULT_USER_TEMPLATE.format(passages=passages, question=question)
            prompts.append(
                [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": content}]
            )
        return prompts


def send(client, url: str, model: str, messages: list[dict], method: str, config: ServeLoadConfig):
    """One streamed chat completion; TTFT is the arrival of the first token's text."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": config.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "method": method,
    }
    if config.ratio is not None and parse_method(method).method_class.ratio_option is not None:
        body["ratio"] = config.ratio  # only for the methods that take one (the server refuses it otherwise)
    started = time.perf_counter()
    first: float | None = None
    text, usage, extension = [], {}, {}
    with client.stream("POST", f"{url}/chat/completions", json=body, timeout=config.request_timeout_s) as r:
        if r.status_code != 200:
            raise RuntimeError(f"serve answered {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"serve failed the request: {event['error']}")
            for choice in event.get("choices", []):
                piece = choice["delta"].get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
            usage = event.get("usage") or usage
            extension = event.get("cacheblend") or extension
    done = time.perf_counter()
    return RequestSample(
        ttft_s=(first or done) - started,
        latency_s=done - started,
        tokens=usage.get("completion_tokens", 0),
        answer="".join(text),
        cached_tokens=usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
        server_ttft_s=extension.get("ttft_s", 0.0),
    )


def run_level(
    url: str, model: str, prompts: list, method: str, level: int, config: ServeLoadConfig
) -> ServeRow:
    """``level`` clients at once, each sending ``rounds`` requests back to back (prompts in turn); returns
    the summary of the run."""
    import httpx

    def client_run(index: int) -> list[RequestSample]:
        with httpx.Client() as client:
            return [
                send(client, url, model, prompts[(index * config.rounds + r) % len(prompts)], method, config)
                for r in range(config.rounds)
            ]

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=level) as pool:
        samples = [s for batch in pool.map(client_run, range(level)) for s in batch]
    return load_summary(samples, time.perf_counter() - started)


def run_serve_load(
    corpus_dir: str | Path,
    questions: Sequence[str],
    config: ServeLoadConfig | None = None,
    log_dir: str | Path | None = None,
) -> ServeResult:
    """Start ``serve`` on ``corpus_dir``, warm it, run every (level, method), stop it."""
    import httpx

    from ...server.process import ServerProcess  # the server's own launcher (needs the [serve] extra)

    config = config or ServeLoadConfig()
    prompts = rag_messages(corpus_dir, questions, config.top_k)
    if not prompts:
        raise ValueError("the serve load test needs at least one question")
    max_batch = config.max_batch or max(config.levels)
    log_path = Path(log_dir or corpus_dir) / "serve-load.log"
    env = {"CACHEBLEND_BATCH_MAX_REQUESTS": str(max_batch)}
    rows: dict[str, dict[str, ServeRow]] = {method: {} for method in config.methods}
    with ServerProcess(corpus_dir, log_path, env=env) as server:
        model = server.health()["model"]
        with httpx.Client() as client:
            for method in config.methods:  # stores every chunk's KV; first-use costs stay out of the timing
                for messages in prompts:
                    send(client, server.url, model, messages, method, config)
        for level in config.levels:
            for method in config.methods:
                row = run_level(server.url, model, prompts, method, level, config)
                rows[method][str(level)] = row
                log.info("serve load %s x%d: %.3f req/s", method, level, row.requests_per_s)
        health = server.health()
    speedup = {}
    if {"cacheblend", "full_recompute"} <= set(rows):
        speedup = {
            str(level): rows["cacheblend"][str(level)].requests_per_s
            / rows["full_recompute"][str(level)].requests_per_s
            for level in config.levels
        }
    return ServeResult(
        levels=list(config.levels),
        rounds=config.rounds,
        max_tokens=config.max_tokens,
        top_k=config.top_k,
        ratio=config.ratio,
        max_batch=max_batch,
        prompts=len(prompts),
        methods=rows,
        speedup_cacheblend_vs_full=speedup,
        scheduler={k: health["scheduler"][k] for k in ("completed", "max_rows", "mean_batch", "cancelled")},
    )


def section_serve(ctx: BenchContext) -> ServeResult:
    """The load test through ``serve`` (:func:`run_serve_load`) on the sample corpus, ingested
    here with its chunk KV."""
    config = ctx.config
    sources, questions = copy_sample_corpus(ctx, "serve-sources")
    corpus_dir = ctx.work_dir / "serve-corpus"
    engine = Engine(ctx.model, corpus_dir / "kv", config=get_settings())
    try:
        ingest([sources], corpus_dir, chunk_tokens=config.chunk_tokens, engine=engine, config=get_settings())
    finally:
        engine.close()
    load = ServeLoadConfig(
        levels=config.serve_levels,
        rounds=config.serve_rounds,
        max_tokens=config.serve_max_new_tokens,
        top_k=config.top_k,
        ratio=config.ratio,
    )
    result = run_serve_load(corpus_dir, [q["question"] for q in questions], load, log_dir=ctx.work_dir)
    return replace(result, chunk_tokens=config.chunk_tokens)


def render_serve(page: Page, serve: ServeResult) -> list[str]:
    rows = []
    for level in serve.levels:
        for method, levels in serve.methods.items():
            r = levels[str(level)]
            rows.append(
                [
                    level,
                    f"`{method}`",
                    r.requests,
                    fmt(r.requests_per_s, 3),
                    fmt(r.ttft_p50_s, 2),
                    fmt(r.ttft_p95_s, 2),
                    fmt(r.server_ttft_p50_s, 2),
                    fmt(r.cached_tokens_mean, 0),
                ]
            )
    speedup = ", ".join(f"{level} clients: {x:.2f}x" for level, x in serve.speedup_cacheblend_vs_full.items())
    ratio = f"r = {serve.ratio:g}" if serve.ratio is not None else "r chosen by the server"
    return [
        f"A real `serve` process on loopback; each client streams {serve.rounds} chat completions back "
        f"to back (the engine's RAG prompt with the top {serve.top_k} chunks of {serve.chunk_tokens} "
        f"tokens pasted in as text, recognised by the server; {serve.max_tokens} new tokens, greedy; "
        f"cacheblend at {ratio}). TTFT as the client sees it: from sending the request to the first "
        "streamed token (HTTP, recognition, queueing, fusion); the server's own TTFT beside it. Batch "
        f"scheduler of {serve.max_batch} slots.",
        "",
        table(
            [
                "clients",
                "method",
                "requests",
                "requests/s",
                "TTFT p50 (s)",
                "TTFT p95 (s)",
                "server TTFT p50 (s)",
                "cached tokens",
            ],
            rows,
        ),
        "",
        f"Requests/s of cacheblend over full prefill: {speedup or '–'}.",
    ]
