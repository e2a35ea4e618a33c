"""Section ``ttft``: time to first token at N chunks x T tokens of real text (MuSiQue paragraphs cut into
chunks) and a fixed question, for our full prefill, Hugging Face ``transformers`` on the same prompt (only
the last position's logits, as a fair peer), prefix_cache, full_reuse, cacheblend with its chunk KV in the
RAM tier and on disk (RAM tier evicted before each run), and epic; sweeping the chunk count and the chunk
length. Runs are interleaved (round robin over methods) and the median is kept."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...blend.methods import Reuse
from ...blend.spec import parse_method
from ...engine import ChunkRef, EdgeTimings, Engine, GenerationRequest, SamplingParams
from ...engine.fidelity import store_in_ram
from ...models.runtime import LayerwiseModel
from ...records import OpenRecord
from ...settings import get_settings
from ...store.profile import drop_page_cache
from ..engines import settings_store
from ..markdown import fmt, table
from .config import BenchContext
from .page import Page, checks_lines
from .record import Check

# The TTFT table's columns, in order: label -> (method, KV tier). "transformers" is the HF peer;
# "disk" evicts the RAM tier and drops the chunk files from the page cache before the run (cold).
# cacheblend_hkvd is the paper's selection rule (the default before the query probe) at the same ratio.
TTFT_COLUMNS = {
    "transformers": ("hf", None),
    "full_prefill": ("full_recompute", "ram"),
    "prefix_cache": ("prefix_cache", "ram"),
    "full_reuse": ("full_reuse", "ram"),
    "cacheblend_ram": ("cacheblend", "ram"),
    "cacheblend_disk": ("cacheblend", "disk"),
    "cacheblend_hkvd": ("cacheblend_hkvd@shift=false", "ram"),
    "epic": ("epic", "ram"),
}
# The columns' names in BENCHMARKS.md and the TTFT plot.
TTFT_LABELS = {
    "transformers": "transformers (full prefill)",
    "full_prefill": "full prefill (ours)",
    "prefix_cache": "prefix_cache",
    "full_reuse": "full_reuse",
    "cacheblend_ram": "cacheblend, RAM tier",
    "cacheblend_disk": "cacheblend, disk tier (cold)",
    "cacheblend_hkvd": "cacheblend with HKVD selection, RAM tier",
    "epic": "epic",
}


@dataclass(frozen=True)
class TtftPoint(OpenRecord):
    """Every column at one (chunk count, chunk length): median TTFT and every sample per column label,
    the engine's compute fraction and load wait (not for transformers), and the speed-ups."""

    num_chunks: int
    chunk_tokens: int
    prompt_tokens: int
    ttft_s: dict[str, float]
    samples_s: dict[str, list[float]]
    compute_fraction: dict[str, float]
    load_wait_s: dict[str, float]
    speedup: dict[str, float]


@dataclass(frozen=True)
class TtftResult(OpenRecord):
    """The sweep's points, the headline point (the config's chunk count and length, when swept) and the
    claims checked on it."""

    ratio: float
    repeats: int
    kv_dtype: str
    question: str
    points: list[TtftPoint]
    headline: TtftPoint | None
    checks: list[Check]


def engine_ttft(
    engine: Engine, question: str, refs: list[ChunkRef], label: str, ratio: float
) -> dict[str, float]:
    """One TTFT column's run of ``question`` over ``refs`` (``label``: a column of :data:`TTFT_COLUMNS`),
    submitted through the engine as a user's request is."""
    method, tier = TTFT_COLUMNS[label]
    spec = parse_method(method).with_ratio(ratio, where_taken=True)
    if tier == "disk":
        only_on_disk(engine, refs)
    started = time.perf_counter()
    segments = engine.rag_segments(question, refs, spec)
    edge = EdgeTimings(prompt_s=time.perf_counter() - started)
    sampling = SamplingParams(max_tokens=1, diagnostics=True)
    # through the engine's one entry, timed from before the prompt was laid out (as a user's call is)
    result = engine.submit(GenerationRequest(segments, spec.build(), sampling, started, edge)).result()
    assert result.diagnostics is not None
    out = {
        "ttft_s": result.ttft_s,
        "compute_fraction": result.diagnostics.compute_fraction,
        "load_wait_s": result.load_wait_s,
        "prompt_tokens": result.prompt_tokens,
    }
    if tier == "disk":
        store_in_ram(engine, question, refs)  # the other columns measure with their KV in RAM
    return out


def only_on_disk(engine: Engine, refs: Sequence[ChunkRef]) -> None:
    """Every chunk's KV only on disk (the RAM tier evicted), its file dropped from the OS page cache: the
    cold disk column's start (scripts/prefetch_ttft.py at 929a489 --tier disk too)."""
    engine.store.evict_ram()
    for chunk in refs:
        path = engine.store.path_for(engine.chunk_key(chunk.token_ids))
        if path.is_file():
            drop_page_cache(path)


@torch.inference_mode()
def hf_ttft(model: LayerwiseModel, ids: Sequence[int]) -> float:
    """Seconds for ``transformers`` to prefill ``ids`` and pick the first token (last logits only)."""
    started = time.perf_counter()
    input_ids = torch.tensor([list(ids)], device=model.device)
    logits = model.hf_model(input_ids=input_ids, logits_to_keep=1, use_cache=True).logits
    int(logits[0, -1].argmax())
    return time.perf_counter() - started


def measure_ttft_point(
    engine: Engine, question: str, chunks: list[tuple[int, ...]], repeats: int, ratio: float
) -> TtftPoint:
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
            measured = engine_ttft(engine, question, refs, label, ratio)
            samples[label].append(measured.pop("ttft_s"))
            extra[label] = measured
    medians = {label: statistics.median(values) for label, values in samples.items()}
    return TtftPoint(
        num_chunks=len(chunks),
        chunk_tokens=len(chunks[0]),
        prompt_tokens=len(prompt_ids),
        ttft_s=medians,
        samples_s=samples,
        compute_fraction={label: e["compute_fraction"] for label, e in extra.items()},
        load_wait_s={label: e["load_wait_s"] for label, e in extra.items()},
        speedup={
            "full_prefill/cacheblend_ram": medians["full_prefill"] / medians["cacheblend_ram"],
            "transformers/cacheblend_ram": medians["transformers"] / medians["cacheblend_ram"],
            "full_prefill/cacheblend_disk": medians["full_prefill"] / medians["cacheblend_disk"],
            "cacheblend_ram/cacheblend_hkvd": medians["cacheblend_ram"] / medians["cacheblend_hkvd"],
            "prefix_cache/full_prefill": medians["prefix_cache"] / medians["full_prefill"],
            "full_prefill/transformers": medians["full_prefill"] / medians["transformers"],
            "compute_ceiling_cacheblend": 1.0 / extra["cacheblend_ram"]["compute_fraction"],
        },
    )


def section_ttft(ctx: BenchContext) -> TtftResult:
    config = ctx.config
    store = settings_store(ctx.work_dir / "ttft-kv", ctx.model.fingerprint, ctx.model.shape)
    engine = Engine(ctx.model, store, config=get_settings())
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
        (r for r in results if (r.num_chunks, r.chunk_tokens) == (config.num_chunks, config.chunk_tokens)),
        None,
    )
    return TtftResult(
        ratio=config.ratio,
        repeats=config.repeats,
        kv_dtype=store.kv_dtype_name,
        question=ctx.question,
        points=results,
        headline=headline,
        checks=_ttft_checks(headline, results) if headline else [],
    )


def _ttft_checks(headline: TtftPoint, points: Sequence[TtftPoint]) -> list[Check]:
    """The TTFT claims (and the default's speed claim) on this run's numbers."""
    speedup = headline.speedup
    worst_prefix = max(p.speedup["prefix_cache/full_prefill"] for p in points)
    full_ram, hf_ram = speedup["full_prefill/cacheblend_ram"], speedup["transformers/cacheblend_ram"]
    full_disk, full_hf = speedup["full_prefill/cacheblend_disk"], speedup["full_prefill/transformers"]
    ram_hkvd = speedup["cacheblend_ram/cacheblend_hkvd"]
    return [
        Check("full prefill / cacheblend (RAM tier) TTFT >= 5x", full_ram >= 5.0, full_ram),
        Check("transformers / cacheblend (RAM tier) TTFT >= 5x", hf_ram >= 5.0, hf_ram),
        Check(
            "full prefill / cacheblend (disk tier, cold page cache) TTFT >= 4x", full_disk >= 4.0, full_disk
        ),
        Check("our full prefill <= 1.1x transformers", full_hf <= 1.1, full_hf),
        Check(
            "prefix_cache <= full prefill at every sweep point (worst ratio shown)",
            worst_prefix <= 1.0,
            worst_prefix,
        ),
        Check(
            "the default cacheblend's TTFT within 10% of HKVD selection's at the same ratio",
            ram_hkvd <= 1.1,
            ram_hkvd,
        ),
    ]


def render_ttft(page: Page, ttft: TtftResult) -> list[str]:
    parts: list[str] = []
    parts.append(
        f"Fixed question, real text (MuSiQue paragraphs cut into chunks), chunk KV in "
        f"{ttft.kv_dtype}; cacheblend at r = {ttft.ratio:g}. TTFT runs from building the prompt "
        "(KV look-ups included) to the first token; median of "
        f"{ttft.repeats} interleaved runs, every method's KV in the RAM tier except for the disk "
        "tier column, which evicts the RAM tier and drops the chunk files from the OS page cache "
        "before each run (posix_fadvise DONTNEED), so their bytes come from the device."
    )
    head = ttft.headline
    if head:
        full = head.ttft_s["full_prefill"]
        parts += [
            "",
            f"At {head.num_chunks} x {head.chunk_tokens} tokens ({head.prompt_tokens} prompt tokens):",
            "",
            table(
                ["method", "TTFT (s)", "full prefill / method", "compute fraction"],
                [
                    [
                        TTFT_LABELS[label],
                        fmt(seconds, 3),
                        fmt(full / seconds, 2),
                        fmt(head.compute_fraction.get(label), 3),
                    ]
                    for label, seconds in head.ttft_s.items()
                ],
            ),
            "",
            checks_lines(ttft.checks),
            f"- compute ceiling of cacheblend at this size (1 / compute fraction): "
            f"{head.speedup['compute_ceiling_cacheblend']:.2f}x",
        ]
    labels = list(TTFT_LABELS)
    parts += [
        "",
        "Sweeps (TTFT in s):",
        "",
        table(
            ["chunks x tokens", *(TTFT_LABELS[label] for label in labels), "full / cacheblend"],
            [
                [
                    f"{p.num_chunks} x {p.chunk_tokens}",
                    *(fmt(p.ttft_s[label], 3) for label in labels),
                    fmt(p.speedup["full_prefill/cacheblend_ram"], 2),
                ]
                for p in ttft.points
            ],
        ),
    ]
    return parts + page.plot("ttft", "TTFT vs chunk count and chunk length")
