"""Time to first token of vLLM's own full prefill against vLLM + CacheBlend, side by side.

One real RAG prompt (a MuSiQue case: its question and ``num_chunks`` of its paragraphs cut to
``chunk_tokens`` tokens) is served repeatedly by one :class:`VLLMEngine`, the two methods interleaved, and
the median of ``repeats`` is reported. Chunk KV is precomputed before timing (as ingest would do); each
CacheBlend timing includes reading it from the store, fusing and writing the fused KV into vLLM's cache.
vLLM's prefix cache is off, so every full prefill really prefills.

Run: ``python -m cacheblend_rag.engine.vllm.bench OUT.json [--chunks 6 --chunk-tokens 512 --repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...blend.methods import Reuse, parse_method
from ..prompt import ChunkRef
from ..sampling import SamplingParams

FULL, BLEND = "vllm_full_prefill", "vllm_cacheblend"


@dataclass
class VLLMBenchConfig:
    num_chunks: int = 6
    chunk_tokens: int = 512
    repeats: int = 3
    ratio: float = 0.15
    data: str = "musique"
    model: str | None = None

    def __post_init__(self) -> None:
        if self.num_chunks < 1 or self.chunk_tokens < 1:
            raise ValueError("--chunks and --chunk-tokens must be >= 1")
        if self.repeats < 3:
            raise ValueError(f"--repeats must be >= 3 for a median, got {self.repeats}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"--ratio must be in [0, 1], got {self.ratio}")


def rag_prompt(config: VLLMBenchConfig, tokenizer) -> tuple[str, list[ChunkRef]]:
    """The first case with ``num_chunks`` paragraphs of at least ``chunk_tokens`` tokens, cut to that."""
    from ...eval.datasets import load_dataset

    for case in load_dataset(config.data).cases:
        chunks = []
        for context in case.contexts:
            ids = tokenizer(context.document, add_special_tokens=False)["input_ids"]
            if len(ids) >= config.chunk_tokens:
                chunks.append(ChunkRef(tuple(ids[: config.chunk_tokens]), f"p{len(chunks)}"))
            if len(chunks) == config.num_chunks:
                return case.question, chunks
    raise ValueError(
        f"no case of {config.data!r} has {config.num_chunks} paragraphs of {config.chunk_tokens} tokens"
    )


def run(config: VLLMBenchConfig, work_dir: Path) -> dict[str, Any]:
    import vllm

    from .engine import VLLMEngine

    load_before = os.getloadavg()
    started = time.perf_counter()
    engine = VLLMEngine(
        config.model,
        store=work_dir / "kv",
        enable_prefix_caching=False,
        max_model_len=config.num_chunks * config.chunk_tokens + 512,
    )
    startup_s = time.perf_counter() - started
    first_token = SamplingParams(max_new_tokens=1)
    try:
        question, chunks = rag_prompt(config, engine.model.tokenizer)
        precompute_started = time.perf_counter()
        engine.rag_segments(question, chunks, Reuse.CHUNKS)  # the worker precomputes and stores chunk KV
        precompute_s = time.perf_counter() - precompute_started
        samples: dict[str, list[float]] = {FULL: [], BLEND: []}
        blends, first_tokens = [], {}
        for repeat in range(config.repeats + 1):  # the first round warms both paths up and is not counted
            for label, method in ((FULL, "full_recompute"), (BLEND, "cacheblend")):
                round_started = time.perf_counter()
                segments = engine.rag_segments(question, chunks, method)
                segments_s = time.perf_counter() - round_started
                result = engine.generate(segments, parse_method(method).with_ratio(config.ratio), first_token)
                first_tokens[label] = result.token_ids
                if repeat == 0:
                    continue
                samples[label].append(segments_s + result.ttft_s)
                if label == BLEND:
                    blends.append(result)
        medians = {label: statistics.median(values) for label, values in samples.items()}
        prompt_tokens = blends[-1].prompt_tokens
    finally:
        engine.close()
    return {
        "benchmark": "vllm_ttft",
        "vllm_version": vllm.__version__,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "model": engine.model.name,
        "num_chunks": config.num_chunks,
        "chunk_tokens": config.chunk_tokens,
        "prompt_tokens": prompt_tokens,
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
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "note": "TTFT measured in the calling process, from building the segments to the first token; "
        "the CPU may be shared with other processes, so compare the two columns of one run",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file to write the results to")
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--data", default="musique", help="bundled data set name or path to one")
    parser.add_argument("--model", default=None, help="model name or local HF folder (default model)")
    args = parser.parse_args(argv)
    config = VLLMBenchConfig(args.chunks, args.chunk_tokens, args.repeats, args.ratio, args.data, args.model)
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as work:
        results = run(config, Path(work))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    medians = results["ttft_s"]
    print(
        f"TTFT median of {config.repeats}: vLLM full prefill {medians[FULL]:.3f} s, "
        f"vLLM + CacheBlend {medians[BLEND]:.3f} s ({results['speedup_full_over_cacheblend']:.2f}x); "
        f"{results['prompt_tokens']} prompt tokens -> {args.out}"
    )


if __name__ == "__main__":  # vLLM starts its engine in spawned processes, which re-import the main module
    main()
