"""The benchmark suite behind ``cacheblend-rag bench``: every timing side by side in one run.

Sections (each can be run alone with ``--only``):

- ``ttft``: time to first token at N chunks x T tokens of real text (MuSiQue paragraphs cut into chunks)
  and a fixed question, for our full prefill, Hugging Face ``transformers`` on the same prompt (only the
  last position's logits, as a fair peer), prefix_cache, full_reuse, cacheblend with its chunk KV in the
  RAM tier and on disk (RAM tier evicted before each run), and epic; sweeping the chunk count and the
  chunk length. Runs are interleaved (round robin over methods) and the median is kept.
- ``prefill``: our layer-wise full prefill against ``transformers``' forward on the same token ids.
- ``store``: the store's loading benchmark (:func:`cacheblend_rag.store.bench.bench_loading`) on real
  chunks, and storage bytes per chunk per dtype.
- ``deviation``: attention and KV deviation against full prefill vs the recompute ratio on real RAG
  prompts (MuSiQue questions with their top-k retrieved chunks), with epic and full_reuse beside it.
- ``ingest``: ingest throughput of the sample corpus and query TTFT per method on it.
- ``throughput``: requests/s and TTFT percentiles of concurrent requests with overlapping chunk sets,
  per method, through the batching scheduler at several concurrency levels and one after another.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..blend.diagnostics import measure_deviation
from ..blend.methods import Reuse, parse_method
from ..engine import ChunkRef, Engine, SamplingParams
from ..engine.scheduler import RagQuestion, RequestTiming, bench_runner, overlapping_musique_requests
from ..errors import EvalDataError
from ..models.runtime import LayerwiseModel
from ..settings import get_settings
from ..store.kvstore import KVStore
from .datasets import load_dataset, select_cases
from .harness import (
    RecordingEngine,
    default_kv_dir,
    machine_info,
    prompt_builder,
    retrieve_chunks,
    store_in_ram,
)

log = logging.getLogger(__name__)

BENCH_FORMAT = "cacheblend-rag-bench/1"
SECTIONS = ("ttft", "prefill", "store", "deviation", "ingest", "throughput")
SAMPLE_CORPUS = Path(__file__).resolve().parents[2] / "examples" / "data"
# The TTFT table's columns, in order: label -> (method, KV tier). "transformers" is the HF peer.
TTFT_COLUMNS = {
    "transformers": ("hf", None),
    "full_prefill": ("full_recompute", "ram"),
    "prefix_cache": ("prefix_cache", "ram"),
    "full_reuse": ("full_reuse", "ram"),
    "cacheblend_ram": ("cacheblend", "ram"),
    "cacheblend_disk": ("cacheblend", "disk"),
    "epic": ("epic", "ram"),
}
QUERY_METHODS = ("full_recompute", "prefix_cache", "full_reuse", "cacheblend", "epic")
THROUGHPUT_METHODS = ("full_recompute", "prefix_cache", "cacheblend")


@dataclass
class BenchConfig:
    """What the benchmark runs. :meth:`quick_config` shrinks everything to a smoke test of minutes."""

    quick: bool = False
    sections: tuple[str, ...] = SECTIONS
    repeats: int = 3
    ratio: float = 0.15
    num_chunks: int = 6
    chunk_tokens: int = 512
    chunk_counts: tuple[int, ...] = (3, 6, 12)
    chunk_lengths: tuple[int, ...] = (256, 512, 1024)
    prefill_tokens: int = 3072
    deviation_prompts: int = 20
    deviation_ratios: tuple[float, ...] = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3)
    top_k: int = 6
    throughput_requests: int = 8
    throughput_levels: tuple[int, ...] = (1, 4, 8, 16)
    throughput_max_new_tokens: int = 16
    query_max_new_tokens: int = 16
    ingest_max_chars: int | None = None  # cut each corpus file to this many characters (quick runs)
    ingest_files: int | None = None  # use only the first N corpus files (quick runs)
    data: str = "musique"
    model: str | None = None
    kv_dir: Path | None = None  # persistent KV of the deviation/throughput prompts (default: eval's)
    work_dir: Path | None = None  # scratch stores (default: under the settings home)

    @classmethod
    def quick_config(cls, **overrides: Any) -> BenchConfig:
        """Tiny sizes that exercise every code path; its timings mean nothing."""
        base = cls(
            quick=True,
            repeats=1,
            num_chunks=3,
            chunk_tokens=64,
            chunk_counts=(2, 3),
            chunk_lengths=(32, 64),
            prefill_tokens=256,
            deviation_prompts=2,
            deviation_ratios=(0.0, 0.15),
            top_k=3,
            throughput_requests=2,
            throughput_levels=(1, 2),
            throughput_max_new_tokens=2,
            query_max_new_tokens=2,
            ingest_max_chars=1500,
            ingest_files=1,
        )
        return replace(base, **overrides)

    def __post_init__(self) -> None:
        unknown = [s for s in self.sections if s not in SECTIONS]
        if unknown:
            raise ValueError(
                f"unknown bench section(s) {', '.join(unknown)}; available: {', '.join(SECTIONS)}"
            )
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")


@dataclass
class BenchContext:
    """What every section shares: the model, the real text, the config, scratch space."""

    config: BenchConfig
    model: LayerwiseModel
    work_dir: Path
    question: str
    text_ids: list[int]  # real text (MuSiQue paragraphs), tokenized once, cut into chunks by the sections

    def chunk_ids(self, count: int, length: int) -> list[tuple[int, ...]]:
        needed = count * length
        if needed > len(self.text_ids):
            raise ValueError(
                f"{count} x {length} tokens exceed the {len(self.text_ids)} tokens of bench text"
            )
        return [tuple(self.text_ids[i * length : (i + 1) * length]) for i in range(count)]


def make_context(config: BenchConfig, model: LayerwiseModel) -> BenchContext:
    dataset = load_dataset(config.data)
    # one context per case: a case's contexts are overlapping windows of the same articles
    paragraphs = [case.contexts[0].text for case in dataset.cases]
    needed = max(
        max(config.chunk_counts) * config.chunk_tokens,
        config.num_chunks * max(config.chunk_lengths),
        config.prefill_tokens,
        config.num_chunks * config.chunk_tokens,
    )
    ids: list[int] = []
    for paragraph in paragraphs:  # tokenize only as much text as the largest section needs
        ids += model.tokenizer(paragraph + "\n\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= needed:
            break
    work_dir = config.work_dir or get_settings().home / "bench"
    work_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="run-", dir=work_dir))
    question = next(c.question for c in dataset.cases if c.question)
    return BenchContext(config, model, scratch, question, ids)


# -- ttft --------------------------------------------------------------------------------------------


def _engine_ttft(
    engine: RecordingEngine, question: str, refs: list[ChunkRef], label: str, ratio: float
) -> dict[str, float]:
    method, tier = TTFT_COLUMNS[label]
    spec = parse_method(method).with_ratio(ratio)
    if tier == "disk":
        engine.store.evict_ram()
    started = time.perf_counter()
    segments = engine.rag_segments(question, refs, spec)
    segments_s = time.perf_counter() - started
    result = engine.generate(segments, spec.build(), SamplingParams(max_new_tokens=1))
    fusion = engine.last_fusion
    assert fusion is not None
    out = {
        "ttft_s": segments_s + result.ttft_s,
        "compute_fraction": fusion.compute_fraction,
        "load_wait_s": fusion.load_wait_s,
        "prompt_tokens": fusion.num_tokens,
    }
    engine.last_fusion = None
    if tier == "disk":
        store_in_ram(engine, question, refs)  # the other columns measure with their KV in RAM
    return out


@torch.inference_mode()
def hf_ttft(model: LayerwiseModel, ids: Sequence[int]) -> float:
    """Seconds for ``transformers`` to prefill ``ids`` and pick the first token (last logits only)."""
    started = time.perf_counter()
    input_ids = torch.tensor([list(ids)], device=model.device)
    logits = model.hf_model(input_ids=input_ids, logits_to_keep=1, use_cache=True).logits
    int(logits[0, -1].argmax())
    return time.perf_counter() - started


def measure_ttft_point(
    engine: RecordingEngine, question: str, chunks: list[tuple[int, ...]], repeats: int, ratio: float
) -> dict[str, Any]:
    """All TTFT columns at one (chunk count, chunk length) point, interleaved, median of ``repeats``."""
    refs = [ChunkRef(ids) for ids in chunks]
    store_in_ram(engine, question, refs)
    prompt_ids = [t for s in engine.rag_segments(question, refs, Reuse.NOTHING) for t in s.token_ids]
    samples: dict[str, list[float]] = {label: [] for label in TTFT_COLUMNS}
    extra: dict[str, dict[str, float]] = {}
    for _ in range(repeats):
        for label in TTFT_COLUMNS:
            if label == "transformers":
                samples[label].append(hf_ttft(engine.model, prompt_ids))
                continue
            measured = _engine_ttft(engine, question, refs, label, ratio)
            samples[label].append(measured.pop("ttft_s"))
            extra[label] = measured
    medians = {label: statistics.median(values) for label, values in samples.items()}
    return {
        "num_chunks": len(chunks),
        "chunk_tokens": len(chunks[0]),
        "prompt_tokens": len(prompt_ids),
        "ttft_s": medians,
        "samples_s": samples,
        "compute_fraction": {label: e["compute_fraction"] for label, e in extra.items()},
        "load_wait_s": {label: e["load_wait_s"] for label, e in extra.items()},
        "speedup": {
            "full_prefill/cacheblend_ram": medians["full_prefill"] / medians["cacheblend_ram"],
            "transformers/cacheblend_ram": medians["transformers"] / medians["cacheblend_ram"],
            "full_prefill/cacheblend_disk": medians["full_prefill"] / medians["cacheblend_disk"],
            "compute_ceiling_cacheblend": 1.0 / extra["cacheblend_ram"]["compute_fraction"],
        },
    }


def section_ttft(ctx: BenchContext) -> dict[str, Any]:
    config = ctx.config
    store = KVStore(ctx.work_dir / "ttft-kv", ctx.model.fingerprint, ctx.model.shape)
    engine = RecordingEngine(ctx.model, store)
    try:
        points = sorted(
            {(n, config.chunk_tokens) for n in config.chunk_counts}
            | {(config.num_chunks, t) for t in config.chunk_lengths}
        )
        # a warm-up at the smallest point: first calls pay for allocations and lazy initialisation
        measure_ttft_point(engine, ctx.question, ctx.chunk_ids(*points[0]), 1, config.ratio)
        results = [
            measure_ttft_point(engine, ctx.question, ctx.chunk_ids(n, t), config.repeats, config.ratio)
            for n, t in points
        ]
    finally:
        store.close()
    headline = next(
        (
            r
            for r in results
            if (r["num_chunks"], r["chunk_tokens"]) == (config.num_chunks, config.chunk_tokens)
        ),
        None,
    )
    return {
        "ratio": config.ratio,
        "repeats": config.repeats,
        "kv_dtype": store.kv_dtype_name,
        "question": ctx.question,
        "points": results,
        "headline": headline,
        "checks": _ttft_checks(headline) if headline else [],
    }


def _ttft_checks(headline: dict[str, Any]) -> list[dict[str, Any]]:
    speedup = headline["speedup"]
    return [
        {
            "claim": "full prefill / cacheblend TTFT >= 4x",
            "passed": speedup["full_prefill/cacheblend_ram"] >= 4.0,
            "value": speedup["full_prefill/cacheblend_ram"],
        },
        {
            "claim": "transformers / cacheblend TTFT >= 4x",
            "passed": speedup["transformers/cacheblend_ram"] >= 4.0,
            "value": speedup["transformers/cacheblend_ram"],
        },
    ]


# -- prefill -----------------------------------------------------------------------------------------


@torch.inference_mode()
def section_prefill(ctx: BenchContext) -> dict[str, Any]:
    """Issue 2: our full prefill vs ``transformers``' forward on the same ids, interleaved."""
    model, ids = ctx.model, ctx.text_ids[: ctx.config.prefill_tokens]
    ours, theirs = [], []
    model.prefill(ids[:64])  # warm-up
    ours_logits = theirs_logits = None
    for _ in range(ctx.config.repeats):
        started = time.perf_counter()
        ours_logits, _ = model.prefill(ids)
        ours.append(time.perf_counter() - started)
        started = time.perf_counter()
        out = model.hf_model(input_ids=torch.tensor([ids], device=model.device), logits_to_keep=1)
        theirs.append(time.perf_counter() - started)
        theirs_logits = out.logits[:, -1].float()
    ratio = statistics.median(ours) / statistics.median(theirs)
    return {
        "tokens": len(ids),
        "repeats": ctx.config.repeats,
        "ours_s": statistics.median(ours),
        "transformers_s": statistics.median(theirs),
        "samples": {"ours_s": ours, "transformers_s": theirs},
        "ratio_ours_over_transformers": ratio,
        "max_abs_logit_diff": float((ours_logits - theirs_logits).abs().max()),
        "checks": [
            {"claim": "our full prefill <= 1.1x transformers", "passed": ratio <= 1.1, "value": ratio}
        ],
    }


# -- store -------------------------------------------------------------------------------------------


def section_store(ctx: BenchContext) -> dict[str, Any]:
    from ..store.bench import bench_loading, storage_cost

    config = ctx.config
    chunks = ctx.chunk_ids(config.num_chunks, config.chunk_tokens)
    loading = bench_loading(
        ctx.model,
        num_chunks=config.num_chunks,
        tokens=config.chunk_tokens,
        ratio=config.ratio,
        chunk_token_ids=chunks,
        work_dir=ctx.work_dir,
        repeats=config.repeats,
    )
    return {"loading": loading, "storage_bytes": storage_cost(ctx.model.shape, config.chunk_tokens)}


# -- real RAG prompts (deviation, throughput) --------------------------------------------------------


@dataclass
class RagPrompt:
    case_id: int
    question: str
    refs: list[ChunkRef]


def rag_prompts(engine: Engine, config: BenchConfig, count: int) -> list[RagPrompt]:
    """``count`` MuSiQue questions with their top-k chunks (retrieved as in ``eval``), KV stored."""
    from ..corpus.embedder import get_embedder
    from ..text.chunker import Chunker

    dataset = load_dataset(config.data)
    chunker, embedder = Chunker(engine.model.tokenizer, config.chunk_tokens), get_embedder()
    prompts = []
    for case in select_cases(dataset.cases, count, seed=0):
        retrieved, _ = retrieve_chunks(case, chunker, embedder, config.top_k, "qa")
        refs = [ChunkRef(r.token_ids) for r in retrieved]
        for ref in refs:
            engine.ensure_chunk_kv(ref.token_ids)
        prompts.append(RagPrompt(case.case_id, case.question, refs))
    return prompts


def _eval_engine(ctx: BenchContext) -> Engine:
    """An engine over the persistent KV store ``eval`` uses, with eval's QA prompt."""
    kv_dir = ctx.config.kv_dir or default_kv_dir(ctx.model)
    return Engine(ctx.model, kv_dir, prompt_builder(ctx.model.tokenizer, "qa"))


# -- deviation ---------------------------------------------------------------------------------------


def section_deviation(ctx: BenchContext) -> dict[str, Any]:
    """Issue 3: attention/KV deviation vs ratio, with epic (k=16 and k matched to the ratio's cost) and
    full_reuse beside it, on real multi-chunk prompts."""
    config = ctx.config
    engine = _eval_engine(ctx)
    try:
        prompts = rag_prompts(engine, config, config.deviation_prompts)
        cached = [sum(len(r.token_ids) for r in p.refs) / len(p.refs) for p in prompts]
        # EPIC recomputing as many tokens per chunk as cacheblend does at config.ratio
        matched_k = max(1, round(config.ratio * statistics.fmean(cached)))
        labels = [f"cacheblend@{r:g}" for r in config.deviation_ratios]
        labels += ["epic@16", f"epic@{matched_k}", "full_reuse"]
        specs = [parse_method(label) for label in labels]
        per_prompt = []
        for prompt in prompts:
            segments = engine.rag_segments(prompt.question, prompt.refs, Reuse.CHUNKS)
            deviations = measure_deviation(engine.fusor, segments, [s.build() for s in specs])
            per_prompt.append(
                {
                    "case": prompt.case_id,
                    "prompt_tokens": sum(len(s) for s in segments),
                    "methods": {
                        spec.label: {
                            "attention": d.mean_attention,
                            "kv": d.mean_kv,
                            "recompute_ratio": d.recompute_ratio,
                            "attention_per_layer": d.attention,
                        }
                        for spec, d in zip(specs, deviations, strict=True)
                    },
                }
            )
    finally:
        engine.store.close()
    summary = {}
    for spec in specs:
        rows = [p["methods"][spec.label] for p in per_prompt]
        summary[spec.label] = {
            "attention": statistics.fmean(r["attention"] for r in rows),
            "kv": statistics.fmean(r["kv"] for r in rows),
            "recompute_ratio": statistics.fmean(r["recompute_ratio"] for r in rows),
            "ratio": spec.ratio,
        }
    return {
        "prompts": len(per_prompt),
        "ratios": list(config.deviation_ratios),
        "epic_matched_k": matched_k,
        "summary": summary,
        "per_prompt": per_prompt,
        "checks": _deviation_checks(summary, config.ratio, matched_k),
    }


def _deviation_checks(summary: dict[str, Any], ratio: float, matched_k: int) -> list[dict[str, Any]]:
    blend = summary.get(f"cacheblend@{ratio:g}")
    if blend is None:
        return []
    checks = []
    curve = [(e["ratio"], e["attention"]) for e in summary.values() if e["ratio"] is not None]
    if len(curve) >= 2:
        lowest, highest = min(curve), max(curve)
        checks.append(
            {
                "claim": f"attention deviation falls as r rises from {lowest[0]:g} to {highest[0]:g}",
                "passed": highest[1] < lowest[1],
                "value": lowest[1] / highest[1] if highest[1] > 0 else math.inf,
            }
        )
    for other in ("epic@16", f"epic@{matched_k}", "full_reuse"):
        if other in summary:
            checks.append(
                {
                    "claim": f"cacheblend@{ratio:g} deviates less than {other}",
                    "passed": blend["attention"] < summary[other]["attention"],
                    "value": summary[other]["attention"] / blend["attention"],
                }
            )
    return checks


# -- ingest ------------------------------------------------------------------------------------------


def section_ingest(ctx: BenchContext) -> dict[str, Any]:
    """Issue 5: ingest the sample corpus (KV included) into a fresh store, then query TTFT per method."""
    from ..ingest.pipeline import ingest
    from ..rag import CacheBlendRAG

    config = ctx.config
    if not (SAMPLE_CORPUS / "questions.json").is_file():
        raise EvalDataError(
            f"the ingest section needs the sample corpus of a source checkout at {SAMPLE_CORPUS}"
        )
    questions = json.loads((SAMPLE_CORPUS / "questions.json").read_text())
    files = sorted((SAMPLE_CORPUS / "corpus").iterdir())
    if config.ingest_files is not None:
        questions = [
            q for q in questions if Path(q["file"]).name in {f.name for f in files[: config.ingest_files]}
        ]
        files = files[: config.ingest_files]
    corpus_dir = ctx.work_dir / "corpus"
    corpus_dir.mkdir()
    for file in files:
        text = file.read_text()
        (corpus_dir / file.name).write_text(
            text if config.ingest_max_chars is None else _cut(file, text, config)
        )
    engine = Engine(ctx.model, ctx.work_dir / "ingest-kv")
    store_dir = ctx.work_dir / "ingest-store"
    try:
        summary = ingest([corpus_dir], store_dir, chunk_tokens=config.chunk_tokens, engine=engine)
        rag = CacheBlendRAG(store_dir, engine=engine)
        sampling = SamplingParams(max_new_tokens=config.query_max_new_tokens)
        queries: dict[str, list[dict[str, Any]]] = {m: [] for m in QUERY_METHODS}
        for question in questions:
            for method in QUERY_METHODS:
                result = rag.query(
                    question["question"], config.top_k, method, config.ratio, sampling=sampling
                )
                queries[method].append(
                    {
                        "question": question["question"],
                        "answer": result.answer,
                        "ttft_s": result.ttft_s,
                        "retrieval_s": result.retrieval_s,
                        "recompute_ratio": result.recompute_ratio,
                        "prompt_tokens": result.prompt_tokens,
                    }
                )
    finally:
        engine.store.close()
    return {
        "files": summary.files,
        "chunks": summary.chunks,
        "tokens": summary.tokens,
        "kv_chunks": summary.kv_chunks,
        "kv_bytes": summary.kv_bytes,
        "stage_seconds": summary.stage_seconds,
        "work_seconds": summary.work_seconds,
        "chunks_per_s": summary.chunks_per_s,
        "tokens_per_s": summary.tokens_per_s,
        "chunk_tokens": config.chunk_tokens,
        "query_ttft_median_s": {
            m: statistics.median([q["ttft_s"] for q in rows]) for m, rows in queries.items()
        },
        "queries": queries,
    }


def _cut(file: Path, text: str, config: BenchConfig) -> str:
    """The first ``ingest_max_chars`` characters (whole lines for JSON lines files)."""
    limit = config.ingest_max_chars or len(text)
    if file.suffix != ".jsonl":
        return text[:limit]
    kept, size = [], 0
    for line in text.splitlines(keepends=True):
        if kept and size + len(line) > limit:
            break
        kept.append(line)
        size += len(line)
    return "".join(kept)


# -- throughput --------------------------------------------------------------------------------------


def run_sequential(
    engine: Engine, prompts: Sequence[RagQuestion], method: str, sampling: SamplingParams, ratio: float
) -> list[RequestTiming]:
    """The baseline without a scheduler: requests that arrive together are served one after another."""
    spec = parse_method(method).with_ratio(ratio)
    started = time.perf_counter()
    timings = []
    for prompt in prompts:
        segments = engine.rag_segments(prompt.question, prompt.refs, spec)
        before = time.perf_counter() - started
        result = engine.generate(segments, spec, sampling)
        elapsed = time.perf_counter() - started
        timings.append(RequestTiming(before + result.ttft_s, elapsed, len(result.token_ids), result.text))
    return timings


def throughput_requests(engine: Engine, config: BenchConfig, count: int) -> list[RagQuestion]:
    """``count`` MuSiQue questions with overlapping chunk sets (neighbours share half their chunks), their
    chunk and prefix KV stored and in the RAM tier."""
    dataset = load_dataset(config.data)
    cases = [
        {"question": c.question, "ctxs": [{"title": x.title, "text": x.text} for x in c.contexts]}
        for c in select_cases(dataset.cases, count + 1, seed=0)
    ]
    requests = overlapping_musique_requests(
        cases, engine.model.tokenizer, count, config.top_k, config.chunk_tokens
    )
    for request in requests:
        store_in_ram(engine, request.question, request.refs)
    return requests


def _throughput_row(timings: Sequence[RequestTiming], seconds: float) -> dict[str, Any]:
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
    engine = _eval_engine(ctx)
    sampling = SamplingParams(max_new_tokens=config.throughput_max_new_tokens)
    levels = sorted({*config.throughput_levels, config.throughput_requests})
    table: dict[str, dict[str, dict[str, Any]]] = {"sequential": {}, "scheduler": {}}
    try:
        requests = throughput_requests(engine, config, max(levels))
        baseline = requests[: config.throughput_requests]
        for method in THROUGHPUT_METHODS:
            started = time.perf_counter()
            timings = run_sequential(engine, baseline, method, sampling, config.ratio)
            table["sequential"][method] = _throughput_row(timings, time.perf_counter() - started)
            table["scheduler"][method] = {}
            for level in levels:
                started = time.perf_counter()
                timings = bench_runner(engine, requests[:level], method, sampling, config.ratio)
                table["scheduler"][method][str(level)] = _throughput_row(
                    timings, time.perf_counter() - started
                )
    finally:
        engine.store.close()
    return {
        "requests": config.throughput_requests,
        "levels": levels,
        "max_new_tokens": config.throughput_max_new_tokens,
        "chunks_per_request": config.top_k,
        "chunk_tokens": config.chunk_tokens,
        "runners": table,
        "checks": _throughput_checks(table, config.throughput_requests),
    }


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


# -- the run -----------------------------------------------------------------------------------------

_SECTION_FUNCTIONS: dict[str, Callable[[BenchContext], dict[str, Any]]] = {
    "ttft": section_ttft,
    "prefill": section_prefill,
    "store": section_store,
    "deviation": section_deviation,
    "ingest": section_ingest,
    "throughput": section_throughput,
}


def run_bench(
    config: BenchConfig,
    model: LayerwiseModel | None = None,
    previous: dict[str, Any] | None = None,
    command: str = "",
    on_section: Callable[[str, str], None] | None = None,
) -> dict[str, Any]:
    """Run the configured sections; sections not run are kept from ``previous`` (an earlier results
    object) so a partial rerun still yields a complete report."""
    from ..models.loader import load_model

    model = model or load_model(config.model)
    ctx = make_context(config, model)
    results: dict[str, Any] = {
        "format": BENCH_FORMAT,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "model": {"name": model.name, "fingerprint": model.fingerprint, "dtype": str(model.dtype)},
        "machine": machine_info(),
        "commands": {},
        "sections": {},
    }
    if previous is not None and previous.get("format") == BENCH_FORMAT:
        results["sections"].update(previous.get("sections", {}))
        results["commands"].update(previous.get("commands", {}))
    try:
        for name in config.sections:
            if on_section is not None:
                on_section(name, "start")
            started, load_before = time.perf_counter(), os.getloadavg()
            section = _SECTION_FUNCTIONS[name](ctx)
            section["seconds"] = time.perf_counter() - started
            log.info("bench section %s took %.1f s", name, section["seconds"])
            section["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
            section["machine"] = results["machine"]
            results["sections"][name] = section
            results["commands"][name] = command
            if on_section is not None:
                on_section(name, "done")
    finally:
        shutil.rmtree(ctx.work_dir, ignore_errors=True)
    return results
