"""Section ``throughput``: requests/s and TTFT percentiles of concurrent requests with overlapping chunk
sets, per method, through the batch scheduler at several concurrency levels and one after another."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ...blend.spec import parse_method
from ...engine import BatchScheduler, Engine, GenerationRequest, SamplingParams
from ...engine.fidelity import store_in_ram
from ...records import OpenRecord
from ...settings import get_settings
from ..datasets import load_dataset, select_cases
from ..markdown import fmt, table
from .config import BenchConfig, BenchContext
from .page import Page, checks_lines
from .prompts import RagQuestion, eval_engine, overlapping_musique_requests
from .record import Check

THROUGHPUT_METHODS = ("full_recompute", "prefix_cache", "cacheblend")


@dataclass(frozen=True)
class ThroughputRow(OpenRecord):
    """One run of concurrent requests (:func:`throughput_row`): requests/s, tokens/s and TTFT
    percentiles, and every request's timing and answer."""

    requests: int
    seconds: float
    requests_per_s: float
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    requests_detail: list[dict[str, Any]]

    def cells(self) -> list[str]:
        """Its requests/s, tokens/s and TTFT p50 and p95 as table cells."""
        return [
            fmt(self.requests_per_s, 3),
            fmt(self.tokens_per_s, 2),
            fmt(self.ttft_p50_s, 2),
            fmt(self.ttft_p95_s, 2),
        ]


@dataclass(frozen=True)
class Runners(OpenRecord):
    """Per method: one at a time at ``throughput_requests``; through the scheduler per level."""

    sequential: dict[str, ThroughputRow]
    scheduler: dict[str, dict[str, ThroughputRow]]


@dataclass(frozen=True)
class BatchedFusion(OpenRecord):
    """The median runs (by requests/s) with an admission group fused together and one at a time, the
    speed-up, and every run's requests/s."""

    together: ThroughputRow
    one_at_a_time: ThroughputRow
    speedup: float
    samples_requests_per_s: dict[str, list[float]]


@dataclass(frozen=True, kw_only=True)
class ThroughputResult(OpenRecord):
    """Throughput per runner and method, and batched fusion per chunk length (older results lack it)."""

    batched_fusion: dict[str, BatchedFusion] | None = None
    requests: int
    levels: list[int]
    max_new_tokens: int
    chunks_per_request: int
    chunk_tokens: int
    runners: Runners
    checks: list[Check]


@dataclass
class RequestTiming:
    """One request of a throughput run; times are from the moment all requests were submitted."""

    ttft_s: float
    latency_s: float
    tokens: int
    answer: str


def bench_runner(
    engine: Engine,
    prompts: Sequence[RagQuestion],
    method: str,
    sampling: SamplingParams,
    ratio: float,
    max_batch: int | None = None,
    batched_fusion: bool = True,
) -> list[RequestTiming]:
    """Serve ``prompts``, all arriving at once, through a :class:`BatchScheduler`. Building each prompt's
    segments is timed, as it is for the sequential runner; the chunks' KV should already be in the store."""
    spec = parse_method(method).with_ratio(ratio, where_taken=True)
    with BatchScheduler.of(
        engine, get_settings(), max_batch=max_batch, batched_fusion=batched_fusion
    ) as scheduler:
        started = time.perf_counter()
        requests = [
            GenerationRequest.of(engine.rag_segments(p.question, p.refs, spec), spec, sampling)
            for p in prompts
        ]
        handles = scheduler.submit_many(requests)
        results = [handle.result() for handle in handles]
    return [
        RequestTiming(
            handle.first_token_at - started, handle.finished_at - started, len(result.token_ids), result.text
        )
        for handle, result in zip(handles, results, strict=True)
    ]


def run_sequential(
    engine: Engine, prompts: Sequence[RagQuestion], method: str, sampling: SamplingParams, ratio: float
) -> list[RequestTiming]:
    """The baseline without a scheduler: requests that arrive together are served one after another."""
    spec = parse_method(method).with_ratio(ratio, where_taken=True)
    started = time.perf_counter()
    timings = []
    for prompt in prompts:
        segments = engine.rag_segments(prompt.question, prompt.refs, spec)
        before = time.perf_counter() - started
        result = engine.generate(segments, spec, sampling)
        elapsed = time.perf_counter() - started
        timings.append(RequestTiming(before + result.ttft_s, elapsed, len(result.token_ids), result.text))
    return timings


def throughput_requests(
    engine: Engine, config: BenchConfig, count: int, chunk_tokens: int | None = None
) -> list[RagQuestion]:
    """``count`` MuSiQue questions with overlapping chunk sets (neighbours share half their chunks), their
    chunk and prefix KV stored and in the RAM tier."""
    dataset = load_dataset(config.data)
    cases = [
        {"question": c.question, "ctxs": [{"title": x.title, "text": x.text} for x in c.contexts]}
        for c in select_cases(dataset.cases, count + 1, seed=0)
    ]
    requests = overlapping_musique_requests(
        cases, engine.model.tokenizer, count, config.top_k, chunk_tokens or config.chunk_tokens
    )
    for request in requests:
        store_in_ram(engine, request.question, request.refs)
    return requests


def throughput_row(timings: Sequence[Any], seconds: float) -> ThroughputRow:
    """Requests/s, tokens/s and TTFT percentiles of a run; ``timings`` are dataclasses with ``ttft_s`` and
    ``tokens`` (:class:`RequestTiming`, the serve section's samples)."""
    ttfts = [t.ttft_s for t in timings]
    return ThroughputRow(
        requests=len(timings),
        seconds=seconds,
        requests_per_s=len(timings) / seconds,
        tokens_per_s=sum(t.tokens for t in timings) / seconds,
        ttft_p50_s=float(np.percentile(ttfts, 50)),
        ttft_p95_s=float(np.percentile(ttfts, 95)),
        requests_detail=[asdict(t) for t in timings],
    )


def section_throughput(ctx: BenchContext) -> ThroughputResult:
    """Requests/s and TTFT percentiles at each concurrency level, through the batching
    scheduler, beside the one-at-a-time baseline at ``throughput_requests`` (whose greedy answers the
    scheduler's must equal)."""
    config = ctx.config
    engine = eval_engine(ctx)
    sampling = SamplingParams(max_tokens=config.throughput_max_new_tokens)
    levels = sorted({*config.throughput_levels, config.throughput_requests})
    runners = Runners(sequential={}, scheduler={})
    try:
        requests = throughput_requests(engine, config, max(levels))
        baseline = requests[: config.throughput_requests]
        for method in THROUGHPUT_METHODS:
            started = time.perf_counter()
            timings = run_sequential(engine, baseline, method, sampling, config.ratio)
            runners.sequential[method] = throughput_row(timings, time.perf_counter() - started)
            runners.scheduler[method] = {}
            for level in levels:
                started = time.perf_counter()
                timings = bench_runner(engine, requests[:level], method, sampling, config.ratio)
                runners.scheduler[method][str(level)] = throughput_row(timings, time.perf_counter() - started)
        fusion = _batched_fusion_rows(engine, config, sampling)
    finally:
        engine.store.close()
    return ThroughputResult(
        batched_fusion=fusion,
        requests=config.throughput_requests,
        levels=levels,
        max_new_tokens=config.throughput_max_new_tokens,
        chunks_per_request=config.top_k,
        chunk_tokens=config.chunk_tokens,
        runners=runners,
        checks=_throughput_checks(runners, config.throughput_requests),
    )


def _batched_fusion_rows(
    engine: Engine, config: BenchConfig, sampling: SamplingParams
) -> dict[str, BatchedFusion]:
    """Cacheblend through the scheduler at ``throughput_requests`` concurrent requests, their
    prompts fused together vs one at a time, for short (128-token) and full-size chunks; median of
    ``repeats`` interleaved runs each."""
    count, rows = config.throughput_requests, {}
    for chunk_tokens in sorted({128, config.chunk_tokens}):
        requests = throughput_requests(engine, config, count, chunk_tokens)
        runs: dict[str, list[ThroughputRow]] = {"together": [], "one_at_a_time": []}
        for _ in range(config.repeats):
            for label, together in (("together", True), ("one_at_a_time", False)):
                started = time.perf_counter()
                timings = bench_runner(
                    engine, requests, "cacheblend", sampling, config.ratio, batched_fusion=together
                )
                runs[label].append(throughput_row(timings, time.perf_counter() - started))
        together, alone = (
            sorted(runs[label], key=lambda row: row.requests_per_s)[len(runs[label]) // 2]
            for label in ("together", "one_at_a_time")
        )
        rows[str(chunk_tokens)] = BatchedFusion(
            together=together,
            one_at_a_time=alone,
            speedup=together.requests_per_s / alone.requests_per_s,
            samples_requests_per_s={k: [r.requests_per_s for r in v] for k, v in runs.items()},
        )
    return rows


def scheduler_speedup(runners: Runners, batch: int) -> float | None:
    """cacheblend's requests/s through the scheduler over full prefill's, ``batch`` requests at once;
    None where the run timed only one of them."""
    scheduled = runners.scheduler
    if not {"cacheblend", "full_recompute"} <= set(scheduled):
        return None
    level = str(batch)
    return scheduled["cacheblend"][level].requests_per_s / scheduled["full_recompute"][level].requests_per_s


def _throughput_checks(runners: Runners, batch: int) -> list[Check]:
    scheduled, sequential = runners.scheduler, runners.sequential
    checks = []
    ratio = scheduler_speedup(runners, batch)
    if ratio is not None:
        checks.append(
            Check(
                f"scheduler throughput of cacheblend at {batch} requests >= 3x full prefill's",
                ratio >= 3.0,
                ratio,
            )
        )
    for method, row in scheduled.items():
        answers = [r["answer"] for r in row[str(batch)].requests_detail]
        alone = [r["answer"] for r in sequential[method].requests_detail]
        checks.append(
            Check(
                f"{method}: scheduler answers equal the one-at-a-time answers ({batch} requests)",
                answers == alone,
            )
        )
    return checks


def render_throughput(page: Page, thr: ThroughputResult) -> list[str]:
    rows = []
    for method, levels in thr.runners.scheduler.items():
        for level, r in levels.items():
            rows.append(["batching scheduler", f"`{method}`", level, *r.cells()])
    for method, r in thr.runners.sequential.items():
        rows.append(["one at a time", f"`{method}`", r.requests, *r.cells()])
    parts = [
        f"MuSiQue questions with {thr.chunks_per_request} chunks of {thr.chunk_tokens} tokens each, "
        "neighbouring requests sharing half their chunks, all submitted at once; "
        f"{thr.max_new_tokens} new tokens each (greedy). TTFT counts from submission (queueing "
        "included).",
        "",
        table(
            ["runner", "method", "requests", "requests/s", "tokens/s", "TTFT p50 (s)", "TTFT p95 (s)"],
            rows,
        ),
        "",
        checks_lines(thr.checks),
    ]
    if thr.batched_fusion:
        parts += _render_batched_fusion(thr, thr.batched_fusion)
    return parts


def _render_batched_fusion(thr: ThroughputResult, fusion: dict[str, BatchedFusion]) -> list[str]:
    rows = [
        [f"{tokens}", label.replace("_", " "), *getattr(r, label).cells()]
        for tokens, r in fusion.items()
        for label in ("together", "one_at_a_time")
    ]
    # the claim depends on the chunk length: short chunks must gain, full-size ones never lose
    claims = [
        Check(
            f"batched fusion of {thr.requests} requests with {tokens}-token chunks: "
            f"{r.speedup:.2f}x one-at-a-time fusion in requests/s "
            f"({'>= 1.3x' if int(tokens) < thr.chunk_tokens else 'never slower'})",
            r.speedup >= (1.3 if int(tokens) < thr.chunk_tokens else 1.0),
        )
        for tokens, r in fusion.items()
    ]
    return [
        "",
        f"Fusing an admission group together (one projection and one MLP per layer over every "
        f"request's selected tokens) vs one request at a time: `cacheblend`, {thr.requests} "
        "requests submitted at once through the scheduler, median of the interleaved runs.",
        "",
        table(["chunk tokens", "fusion", "requests/s", "tokens/s", "TTFT p50 (s)", "TTFT p95 (s)"], rows),
        "",
        checks_lines(claims),
    ]
