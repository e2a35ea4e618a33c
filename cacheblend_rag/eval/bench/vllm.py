"""Section ``vllm`` (run with ``--only vllm``, in an environment with the [vllm] extra): time to first
token of vLLM's own full prefill against vLLM + CacheBlend, side by side, and the vLLM worker's resident
memory with the fusor on vLLM's own weights against a worker that loads its own copy of them.

One real RAG prompt (a MuSiQue case: its question and ``num_chunks`` of its paragraphs cut to
``chunk_tokens`` tokens) is served repeatedly by one :class:`VLLMEngine`, the two methods interleaved, and
the median of ``repeats`` is reported. Chunk KV is precomputed before timing (as ingest would do); each
CacheBlend timing includes reading it from the store, fusing and writing the fused KV into vLLM's cache.
vLLM's prefix cache is off, so every full prefill really prefills.

Memory: the worker process's RSS right after the engine started and after precomputing the chunks and
serving one CacheBlend request, first for an engine whose fusor loads its own copy of the model
(``share_weights=False``, what the worker did before it drove vLLM's modules), then for the timed engine
(the default: vLLM's own weights) before its timings. At start a copy's weights are memory-mapped from
the checkpoint and mostly not resident yet; the request touches them all.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from ...blend.spec import parse_method
from ...engine import ChunkRef, SamplingParams
from ...errors import EvalDataError
from ...records import INLINE, OpenRecord
from ...settings import get_settings
from ..datasets import load_dataset
from ..markdown import fmt, table
from ..results import machine_info
from .config import BenchConfig, BenchContext
from .page import Page

FULL, BLEND = "vllm_full_prefill", "vllm_cacheblend"
METHODS = {FULL: "full_recompute", BLEND: "cacheblend"}


@dataclass(frozen=True)
class VllmPair(OpenRecord):
    """TTFT of vLLM's full prefill and of vLLM + CacheBlend on one prompt (:func:`ttft_pair`), keyed
    :data:`FULL` and :data:`BLEND`, and what the last CacheBlend request reported."""

    num_chunks: int
    prompt_tokens: int
    ttft_s: dict[str, float]
    samples_s: dict[str, list[float]]
    speedup_full_over_cacheblend: float
    cacheblend: dict[str, Any]
    same_first_token: bool


@dataclass(frozen=True, kw_only=True)
class VllmResult(OpenRecord):
    """The section: the main prompt's pair (its keys are the section's), the pair per prompt size,
    first-token agreement over many prompts, and the worker's memory per weight source; older results
    lack the processor, the sizes, the agreement and the memory."""

    vllm_version: str
    processor: dict[str, Any] | None = None
    chunk_tokens: int
    ratio: float
    repeats: int
    main: VllmPair = field(metadata=INLINE)
    by_chunks: dict[str, VllmPair] | None = None
    first_token_agreement: dict[str, Any] | None = None
    engine_startup_s: float
    chunk_precompute_s: float
    # worker RSS: "copy" = fusor on its own copy of the weights (before), "shared" = on vLLM's (after)
    worker_memory: dict[str, Any] | None = None


def rag_prompt(config: BenchConfig, tokenizer, num_chunks: int | None = None) -> tuple[str, list[ChunkRef]]:
    """The first case with ``num_chunks`` (default: the config's) paragraphs of at least ``chunk_tokens``
    tokens, cut to that; when no case has that many, the first case's question over its paragraphs and
    the next cases' joined and cut into chunks (:func:`joined_prompt`)."""
    num_chunks = num_chunks or config.num_chunks
    cases = load_dataset(config.data).cases
    for case in cases:
        chunks = []
        for context in case.contexts:
            ids = tokenizer(context.document, add_special_tokens=False)["input_ids"]
            if len(ids) >= config.chunk_tokens:
                chunks.append(ChunkRef(tuple(ids[: config.chunk_tokens]), f"p{len(chunks)}"))
            if len(chunks) == num_chunks:
                return case.question, chunks
    return joined_prompt(config, tokenizer, 0, num_chunks)


def joined_prompt(
    config: BenchConfig, tokenizer, index: int, num_chunks: int | None = None
) -> tuple[str, list[ChunkRef]]:
    """Case ``index``'s question over ``num_chunks`` chunks of ``chunk_tokens`` tokens cut from its
    paragraphs, then the following cases' (MuSiQue paragraphs are mostly shorter than a chunk)."""
    num_chunks = num_chunks or config.num_chunks
    cases = load_dataset(config.data).cases
    need = num_chunks * config.chunk_tokens
    ids: list[int] = []
    for case in cases[index:]:
        for context in case.contexts:
            ids.extend(tokenizer(context.document, add_special_tokens=False)["input_ids"])
        if len(ids) >= need:
            size = config.chunk_tokens
            chunks = [ChunkRef(tuple(ids[i * size : (i + 1) * size]), f"j{i}") for i in range(num_chunks)]
            return cases[index].question, chunks
    raise EvalDataError(f"{config.data!r} from case {index} on has fewer than {need} tokens of paragraphs")


def _engine(
    config: BenchConfig, ctx: BenchContext, store: str, share_weights: bool, num_chunks: int | None = None
):
    from ...engine.vllm import VLLMEngine

    return VLLMEngine(
        config.model,
        store=ctx.work_dir / store,
        enable_prefix_caching=False,
        max_model_len=(num_chunks or config.num_chunks) * config.chunk_tokens + 512,
        share_weights=share_weights,
        config=get_settings(),
    )


def worker_memory(
    engine, question: str, chunks: list[ChunkRef], ratio: float
) -> tuple[dict[str, Any], float]:
    """The worker's RSS now (engine just started) and after precomputing the prompt's chunks into the
    engine's empty store and serving one CacheBlend request, with where the fusor's weights come from;
    and the seconds the precompute took."""
    at_start = engine.worker_memory()
    spec = parse_method("cacheblend").with_ratio(ratio, where_taken=True)
    started = time.perf_counter()
    segments = engine.rag_segments(question, chunks, spec)  # the worker precomputes and stores chunk KV
    precompute_s = time.perf_counter() - started
    engine.generate(segments, spec, SamplingParams(max_tokens=1))
    memory = {
        "weights": engine.fusion_weights,
        "at_start": at_start,
        "after_request": engine.worker_memory(),
        **engine.weight_sharing(),
    }
    return memory, precompute_s


def ttft_pair(engine, question: str, chunks: list[ChunkRef], config: BenchConfig) -> VllmPair:
    """TTFT of vLLM's full prefill and of vLLM + CacheBlend on one prompt: the median of ``repeats``
    interleaved runs after a warm-up round, and what the last CacheBlend request reported."""
    first_token = SamplingParams(max_tokens=1)
    samples: dict[str, list[float]] = {FULL: [], BLEND: []}
    blends, first_tokens = [], {}
    for repeat in range(config.repeats + 1):  # the first round warms both paths up and is not counted
        for label, method in METHODS.items():
            spec = parse_method(method).with_ratio(config.ratio, where_taken=True)
            round_started = time.perf_counter()
            segments = engine.rag_segments(question, chunks, spec)
            segments_s = time.perf_counter() - round_started
            result = engine.generate(segments, spec, first_token)
            first_tokens[label] = result.token_ids
            if repeat == 0:
                continue
            samples[label].append(segments_s + result.ttft_s)
            if label == BLEND:
                blends.append(result)
    medians = {label: statistics.median(values) for label, values in samples.items()}
    return VllmPair(
        num_chunks=len(chunks),
        prompt_tokens=blends[-1].prompt_tokens,
        ttft_s=medians,
        samples_s=samples,
        speedup_full_over_cacheblend=medians[FULL] / medians[BLEND],
        cacheblend={
            "claimed_tokens": blends[-1].claimed_tokens,
            "vllm_cached_tokens": blends[-1].vllm_cached_tokens,
            "reused_tokens": blends[-1].reused_tokens,
            "recompute_ratio": blends[-1].recompute_ratio,
            "paged_layers": blends[-1].paged_layers,
            "attention_kernels": [r.attention_kernels for r in blends],
            "attention_choice": blends[-1].attention_choice,
            "fusion_s": [r.fusion_s for r in blends],
            "kv_write_s": [r.kv_write_s for r in blends],
            "store_load_wait_s": [r.load_wait_s for r in blends],
        },
        same_first_token=first_tokens[FULL] == first_tokens[BLEND],
    )


def first_token_agreement(engine, config: BenchConfig, prompts: int) -> dict[str, Any]:
    """On ``prompts`` MuSiQue prompts (case i's question over ``num_chunks`` chunks cut from its
    paragraphs and the next cases'), whether vLLM + CacheBlend's first token is vLLM full prefill's."""
    first_token = SamplingParams(max_tokens=1)
    same = []
    for index in range(prompts):
        question, chunks = joined_prompt(config, engine.model.tokenizer, index)
        tokens = []
        for method in METHODS.values():
            spec = parse_method(method).with_ratio(config.ratio, where_taken=True)
            tokens.append(engine.generate(engine.rag_segments(question, chunks, spec), spec, first_token))
        same.append(tokens[0].token_ids[:1] == tokens[1].token_ids[:1])
    return {"prompts": prompts, "same": sum(same), "per_prompt": same}


def section_vllm(ctx: BenchContext) -> VllmResult:
    import vllm

    machine = machine_info()
    config = ctx.config
    # the same work for both engines up to the memory reading: start, precompute into an empty store, one
    # CacheBlend request; the first engine's fusor loads its own copy of the weights (the former design)
    copy = _engine(config, ctx, "vllm-kv-copy", share_weights=False)
    try:
        memory = {"copy": worker_memory(copy, *rag_prompt(config, copy.model.tokenizer), config.ratio)[0]}
    finally:
        copy.close()
    counts = sorted({config.num_chunks, *config.vllm_chunk_counts})
    started = time.perf_counter()
    engine = _engine(config, ctx, "vllm-kv", share_weights=True, num_chunks=max(counts))
    startup_s = time.perf_counter() - started
    try:
        question, chunks = rag_prompt(config, engine.model.tokenizer)
        memory["shared"], precompute_s = worker_memory(engine, question, chunks, config.ratio)
        main = ttft_pair(engine, question, chunks, config)
        # larger prompts (12 x 512: the second size), each its own first case
        by_chunks = {
            str(n): main
            if n == config.num_chunks
            else ttft_pair(engine, *rag_prompt(config, engine.model.tokenizer, n), config)
            for n in counts
        }
        agreement = first_token_agreement(engine, config, config.vllm_agreement_prompts)
    finally:
        engine.close()
    return VllmResult(
        vllm_version=vllm.__version__,
        processor={k: machine[k] for k in ("cpu", "simd")},  # vLLM's CPU kernels differ by processor
        chunk_tokens=config.chunk_tokens,
        ratio=config.ratio,
        repeats=config.repeats,
        main=main,
        by_chunks=by_chunks,
        first_token_agreement=agreement,
        engine_startup_s=startup_s,
        chunk_precompute_s=precompute_s,
        worker_memory=memory,
    )


def render_vllm(page: Page, vllm: VllmResult) -> list[str]:
    main = vllm.main
    ttft, blend = main.ttft_s, main.cacheblend
    return [
        f"vllm {vllm.vllm_version}, {main.num_chunks} chunks x {vllm.chunk_tokens} tokens of "
        f"MuSiQue text ({main.prompt_tokens} prompt tokens), r = {vllm.ratio:g}; TTFT from building "
        f"the segments to the first token, median of {vllm.repeats} interleaved runs after a warm-up "
        "round; vLLM's prefix cache off.",
        "",
        table(
            ["", "vLLM full prefill", "vLLM + CacheBlend"],
            [
                ["TTFT median (s)", fmt(ttft[FULL]), fmt(ttft[BLEND])],
                ["samples (s)", *(", ".join(fmt(s, 2) for s in main.samples_s[k]) for k in (FULL, BLEND))],
                ["speed-up", "1.00", fmt(main.speedup_full_over_cacheblend, 2)],
            ],
        ),
        "",
        f"Claimed tokens {blend['claimed_tokens']} (vLLM counted {blend['vllm_cached_tokens']} as computed "
        f"externally), {blend['reused_tokens']} reused, recompute ratio {fmt(blend['recompute_ratio'], 3)}; "
        f"same first token: {fmt(main.same_first_token)}; "
        f"engine start {fmt(vllm.engine_startup_s, 1)} s.",
        *vllm_sizes(vllm),
        *_vllm_memory(vllm.worker_memory),
    ]


def vllm_sizes(vllm: VllmResult) -> list[str]:
    """TTFT per prompt size, first-token agreement over many prompts and the processor (older results
    have none of them)."""
    lines = []
    sizes = vllm.by_chunks or {}
    if sizes:
        rows = [
            [
                f"{n} x {vllm.chunk_tokens} ({run.prompt_tokens} tokens)",
                fmt(run.ttft_s[FULL]),
                fmt(run.ttft_s[BLEND]),
                fmt(run.speedup_full_over_cacheblend, 2),
                fmt(run.same_first_token),
                _kernels(run.cacheblend.get("attention_kernels")),
            ]
            for n, run in sorted(sizes.items(), key=lambda item: int(item[0]))
        ]
        header = [
            "prompt",
            "vLLM full prefill (s)",
            "vLLM + CacheBlend (s)",
            "speed-up",
            "same first token",
            "fused layers by attention kernel (last run)",
        ]
        lines += ["", table(header, rows)]
    agreement = vllm.first_token_agreement
    if agreement:
        lines += [
            "",
            f"Same first token as vLLM full prefill on {agreement['same']} of {agreement['prompts']} MuSiQue "
            f"prompts ({vllm.main.num_chunks} x {vllm.chunk_tokens} tokens, r = {vllm.ratio:g}).",
        ]
    processor = vllm.processor
    if processor:
        lines += ["", f"Processor: {processor['cpu']}; SIMD: {' '.join(processor['simd']) or 'unknown'}."]
    return lines


def _kernels(per_run: list[dict[str, int]] | None) -> str:
    """The last CacheBlend run's layers by the kernel that attended them (older results: unknown)."""
    if not per_run or not per_run[-1]:
        return "-"
    return ", ".join(f"{name} {layers}" for name, layers in sorted(per_run[-1].items()))


def _vllm_memory(memory: dict[str, Any] | None) -> list[str]:
    """The worker's resident memory, fusor on its own copy of the weights vs on vLLM's (older results
    have no such numbers)."""
    if not memory:
        return []

    def mib(value: int | None) -> str:
        return fmt(None if value is None else value / 2**20, 0)

    rows = []
    for label, m in (("own copy of the weights", memory["copy"]), ("vLLM's weights", memory["shared"])):
        after = m["after_request"]
        rows.append(
            [
                label,
                mib(m["at_start"]["rss_bytes"]),
                mib(after["rss_bytes"]),
                mib(after.get("rss_anon_bytes")),
                mib(after.get("rss_file_bytes")),
                mib(m["own_bytes"]),
            ]
        )
    saved = memory["copy"]["after_request"]["rss_bytes"] - memory["shared"]["after_request"]["rss_bytes"]
    return [
        "",
        "vLLM worker resident memory (MiB; read after `malloc_trim`) by where the fusor's weights come "
        "from, the same work for both: start, precompute the chunks, one CacheBlend request. At start a "
        "copy's weights are memory-mapped from the checkpoint and mostly not resident yet.",
        "",
        table(
            ["fusor weights", "RSS at start", "RSS after", "anon after", "file after", "fusor's own tensors"],
            rows,
        ),
        "",
        f"Saved by fusing on vLLM's weights: {mib(saved)} MiB of RSS after the request.",
    ]
