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
from typing import Any

from ...blend.spec import parse_method
from ...engine import ChunkRef, SamplingParams
from ...errors import EvalDataError
from ...settings import get_settings
from ..datasets import load_dataset
from .config import BenchConfig, BenchContext

FULL, BLEND = "vllm_full_prefill", "vllm_cacheblend"
METHODS = {FULL: "full_recompute", BLEND: "cacheblend"}


def rag_prompt(config: BenchConfig, tokenizer) -> tuple[str, list[ChunkRef]]:
    """The first case with ``num_chunks`` paragraphs of at least ``chunk_tokens`` tokens, cut to that."""
    for case in load_dataset(config.data).cases:
        chunks = []
        for context in case.contexts:
            ids = tokenizer(context.document, add_special_tokens=False)["input_ids"]
            if len(ids) >= config.chunk_tokens:
                chunks.append(ChunkRef(tuple(ids[: config.chunk_tokens]), f"p{len(chunks)}"))
            if len(chunks) == config.num_chunks:
                return case.question, chunks
    raise EvalDataError(
        f"no case of {config.data!r} has {config.num_chunks} paragraphs of {config.chunk_tokens} tokens"
    )


def _engine(config: BenchConfig, ctx: BenchContext, store: str, share_weights: bool):
    from ...engine.vllm import VLLMEngine

    return VLLMEngine(
        config.model,
        store=ctx.work_dir / store,
        enable_prefix_caching=False,
        max_model_len=config.num_chunks * config.chunk_tokens + 512,
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
    engine.generate(segments, spec, SamplingParams(max_new_tokens=1))
    memory = {
        "weights": engine.fusion_weights,
        "at_start": at_start,
        "after_request": engine.worker_memory(),
        **engine.weight_sharing(),
    }
    return memory, precompute_s


def section_vllm(ctx: BenchContext) -> dict[str, Any]:
    import vllm

    config = ctx.config
    # the same work for both engines up to the memory reading: start, precompute into an empty store, one
    # CacheBlend request; the first engine's fusor loads its own copy of the weights (the former design)
    copy = _engine(config, ctx, "vllm-kv-copy", share_weights=False)
    try:
        memory = {"copy": worker_memory(copy, *rag_prompt(config, copy.model.tokenizer), config.ratio)[0]}
    finally:
        copy.close()
    started = time.perf_counter()
    engine = _engine(config, ctx, "vllm-kv", share_weights=True)
    startup_s = time.perf_counter() - started
    first_token = SamplingParams(max_new_tokens=1)
    try:
        question, chunks = rag_prompt(config, engine.model.tokenizer)
        memory["shared"], precompute_s = worker_memory(engine, question, chunks, config.ratio)
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
    finally:
        engine.close()
    return {
        "vllm_version": vllm.__version__,
        "num_chunks": config.num_chunks,
        "chunk_tokens": config.chunk_tokens,
        "prompt_tokens": blends[-1].prompt_tokens,
        "ratio": config.ratio,
        "repeats": config.repeats,
        "ttft_s": medians,
        "samples_s": samples,
        "speedup_full_over_cacheblend": medians[FULL] / medians[BLEND],
        "cacheblend": {
            "claimed_tokens": blends[-1].claimed_tokens,
            "vllm_cached_tokens": blends[-1].vllm_cached_tokens,
            "reused_tokens": blends[-1].reused_tokens,
            "recompute_ratio": blends[-1].recompute_ratio,
            "fusion_s": [r.fusion_s for r in blends],
            "kv_write_s": [r.kv_write_s for r in blends],
            "store_load_wait_s": [r.load_wait_s for r in blends],
        },
        "same_first_token": first_tokens[FULL] == first_tokens[BLEND],
        "engine_startup_s": startup_s,
        "chunk_precompute_s": precompute_s,
        # worker RSS: "copy" = fusor on its own copy of the weights (before), "shared" = on vLLM's (after)
        "worker_memory": memory,
    }
