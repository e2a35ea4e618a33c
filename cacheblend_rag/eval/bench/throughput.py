"""Section ``throughput``: requests/s and TTFT percentiles of concurrent requests with overlapping chunk
sets, per method, through the batch scheduler at several concurrency levels and one after another."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ...blend.spec import parse_method
from ...engine import BatchRequest, BatchScheduler, Engine, SamplingParams
from ...settings import get_settings
from ..datasets import load_dataset, select_cases
from ..harness import store_in_ram
from .config import BenchConfig, BenchContext
from .prompts import RagQuestion, eval_engine, overlapping_musique_requests

THROUGHPUT_METHODS = ("full_recompute", "prefix_cache", "cacheblend")


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
            BatchRequest(engine.rag_segments(p.question, p.refs, spec), spec, sampling) for p in prompts
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


def throughput_row(timings: Sequence[Any], seconds: float) -> dict[str, Any]:
    """Requests/s, tokens/s and TTFT percentiles of a run; ``timings`` are dataclasses with ``ttft_s`` and
    ``tokens`` (:class:`RequestTiming`, the serve section's samples)."""
    ttfts = [t.ttft_s for t in timings]
    return {
        "requests": len(timings),
        "seconds": seconds,
        "requests_per_s": len(timings) / seconds,
        "tokens_per_s": sum(t.tokens for t in timings) / seconds,
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p95_s": float(np.percentile(ttfts, 95)),
        "requests_detail": [asdict(t) for t in timings],
    }


def section_throughput(ctx: BenchContext) -> dict[str, Any]:
    """Issue 10: requests/s and TTFT percentiles at each concurrency level, through the batching
    scheduler, beside the one-at-a-time baseline at ``throughput_requests`` (whose greedy answers the
    scheduler's must equal)."""
    config = ctx.config
    engine = eval_engine(ctx)
    sampling = SamplingParams(max_new_tokens=config.throughput_max_new_tokens)
    levels = sorted({*config.throughput_levels, config.throughput_requests})
    table: dict[str, dict[str, dict[str, Any]]] = {"sequential": {}, "scheduler": {}}
    try:
        requests = throughput_requests(engine, config, max(levels))
        baseline = requests[: config.throughput_requests]
        for method in THROUGHPUT_METHODS:
            started = time.perf_counter()
            timings = run_sequential(engine, baseline, method, sampling, config.ratio)
            table["sequential"][method] = throughput_row(timings, time.perf_counter() - started)
            table["scheduler"][method] = {}
            for level in levels:
                started = time.perf_counter()
                timings = bench_runner(engine, requests[:level], method, sampling, config.ratio)
                table["scheduler"][method][str(level)] = throughput_row(
                    timings, time.perf_counter() - started
                )
        fusion = _batched_fusion_rows(engine, config, sampling)
    finally:
        engine.store.close()
    return {
        "batched_fusion": fusion,
        "requests": config.throughput_requests,
        "levels": levels,
        "max_new_tokens": config.throughput_max_new_tokens,
        "chunks_per_request": config.top_k,
        "chunk_tokens": config.chunk_tokens,
        "runners": table,
        "checks": _throughput_checks(table, config.throughput_requests),
    }


def _batched_fusion_rows(engine: Engine, config: BenchConfig, sampling: SamplingParams) -> dict[str, Any]:
    """Issue 16: cacheblend through the scheduler at ``throughput_requests`` concurrent requests, their
    prompts fused together vs one at a time, for short (128-token) and full-size chunks; median of
    ``repeats`` interleaved runs each."""
    count, rows = config.throughput_requests, {}
    for chunk_tokens in sorted({128, config.chunk_tokens}):
        requests = throughput_requests(engine, config, count, chunk_tokens)
        runs: dict[str, list[dict[str, Any]]] = {"together": [], "one_at_a_time": []}
        for _ in range(config.repeats):
            for label, together in (("together", True), ("one_at_a_time", False)):
                started = time.perf_counter()
                timings = bench_runner(
                    engine, requests, "cacheblend", sampling, config.ratio, batched_fusion=together
                )
                runs[label].append(throughput_row(timings, time.perf_counter() - started))
        medians = {
            label: sorted(samples, key=lambda row: row["requests_per_s"])[len(samples) // 2]
            for label, samples in runs.items()
        }
        rows[str(chunk_tokens)] = {
            **medians,
            "speedup": medians["together"]["requests_per_s"] / medians["one_at_a_time"]["requests_per_s"],
            "samples_requests_per_s": {k: [r["requests_per_s"] for r in v] for k, v in runs.items()},
        }
    return rows


def _throughput_checks(table: dict[str, dict[str, Any]], batch: int) -> list[dict[str, Any]]:
    scheduled, sequential = table["scheduler"], table["sequential"]
    checks = []
    if {"cacheblend", "full_recompute"} <= set(scheduled):
        ratio = (
            scheduled["cacheblend"][str(batch)]["requests_per_s"]
            / scheduled["full_recompute"][str(batch)]["requests_per_s"]
        )
        checks.append(
            {
                "claim": f"scheduler throughput of cacheblend at {batch} requests >= 3x full prefill's",
                "passed": ratio >= 3.0,
                "value": ratio,
            }
        )
    for method, row in scheduled.items():
        answers = [r["answer"] for r in row[str(batch)]["requests_detail"]]
        alone = [r["answer"] for r in sequential[method]["requests_detail"]]
        checks.append(
            {
                "claim": f"{method}: scheduler answers equal the one-at-a-time answers ({batch} requests)",
                "passed": answers == alone,
            }
        )
    return checks
