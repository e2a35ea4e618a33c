"""Profile one fused prefill (and full prefill, full reuse) with torch.profiler.

    .venv/bin/python scripts/profile_fusion.py [--chunks 6] [--chunk-tokens 512] [--methods ...]
        [--trace DIR] [--rows 25] [--time N]

Builds a RAG prompt of ``--chunks`` MuSiQue chunks of ``--chunk-tokens`` tokens (chunk KV precomputed
behind the chunk context, held in RAM as the RAM tier holds it), warms up, then profiles each method once
and prints the operators that took the most self CPU time, plus wall time per method. ``--trace`` saves a
Chrome trace per method (open in chrome://tracing or Perfetto). ``--time N`` profiles nothing: it times
N fusions per method (after the warm-up) and prints their median. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from cacheblend_rag.blend import DirectLayerKV, Fusor, Segment, parse_method
from cacheblend_rag.blend.segments import ChunkContext, kv_sources, prefill_chunk_kv
from cacheblend_rag.engine.prompt import ChunkRef, PromptBuilder
from cacheblend_rag.eval.datasets import load_dataset
from cacheblend_rag.models.loader import load_model
from cacheblend_rag.models.tokenizer import chunk_context_ids
from cacheblend_rag.settings import get_settings
from cacheblend_rag.text.chunker import Chunker


def musique_chunks(model, chunks: int, chunk_tokens: int) -> list[tuple[int, ...]]:
    """Token ids of ``chunks`` MuSiQue chunks of exactly ``chunk_tokens`` tokens (scripts/profile_round.py
    uses them too)."""
    tok = model.tokenizer
    chunker = Chunker(tok, chunk_tokens)
    pieces = []
    for case in load_dataset("musique").cases:
        for ctx in case.contexts:
            pieces.extend(c.token_ids for c in chunker.split(ctx.document) if c.n_tokens == chunk_tokens)
        if len(pieces) >= chunks:
            break
    if len(pieces) < chunks:  # paragraphs are short: join them into full-size chunks
        ids = [
            t
            for case in load_dataset("musique").cases[:4]
            for c in case.contexts
            for t in tok(c.document, add_special_tokens=False)["input_ids"]
        ]
        pieces = [tuple(ids[i * chunk_tokens : (i + 1) * chunk_tokens]) for i in range(chunks)]
    return [tuple(p) for p in pieces[:chunks]]


def build_prompt(model, chunks: int, chunk_tokens: int):
    tok = model.tokenizer
    context = ChunkContext(chunk_context_ids(tok, "neutral"))
    pieces = musique_chunks(model, chunks, chunk_tokens)
    refs = [ChunkRef(p, None, prefill_chunk_kv(model, p, context).to(torch.float16)) for p in pieces]
    question = "Which river flows through the city where the author of the book was born?"
    segments = PromptBuilder(tok).rag_segments(question, refs)
    # the template's opening is reused exactly, as Engine hands it to the fusor
    head = segments[0].token_ids
    return [Segment.cached(head, prefill_chunk_kv(model, head), exact=True), *segments[1:]]


# operators by what they do (self CPU time): attention kernels (the probe's explicit softmax among them),
# GEMMs of the projections and MLPs, and the copies that place cached KV
_KINDS = {
    "attention": (
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_attention_math",
        "aten::baddbmm",
        "aten::bmm",
        "aten::_softmax",
    ),
    "projections + MLP": ("aten::mm", "aten::addmm"),
    "copies": ("aten::copy_", "aten::_index_put_impl_", "aten::index", "aten::addcmul_"),
}


def shares(averages) -> str:
    """One line per kind of work: its share of the run's self CPU time and its calls; then the probe's
    region (every operator it ran) as a share of the whole."""
    by_key = {event.key: event for event in averages}
    total = sum(event.self_cpu_time_total for event in averages) or 1.0
    lines = ["shares of self CPU time:"]
    for kind, keys in _KINDS.items():
        found = [by_key[k] for k in keys if k in by_key]
        spent = sum(e.self_cpu_time_total for e in found)
        calls = sum(e.count for e in found)
        lines.append(f"  {kind}: {100 * spent / total:.1f} % ({calls} calls)")
    probe = by_key.get("fusion::probe")
    if probe is not None:
        lines.append(f"  the query probe (everything in it): {100 * probe.cpu_time_total / total:.1f} %")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["full_recompute", "full_reuse", "cacheblend"],
        help="method names or specs (cacheblend@ratio=0.15,probe_depth=15)",
    )
    parser.add_argument("--trace", type=Path, default=None, help="folder for Chrome traces")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--time", type=int, default=0, help="time N runs per method, no profiler")
    args = parser.parse_args()

    model = load_model(config=get_settings())  # CACHEBLEND_THREADS, _DEVICE... as before
    segments = build_prompt(model, args.chunks, args.chunk_tokens)
    fusor = Fusor(model)
    print(f"prompt: {sum(len(s) for s in segments)} tokens, {torch.get_num_threads()} threads")
    for name in args.methods:
        method = parse_method(name).build()  # a spec: cacheblend@ratio=0.15,probe_depth=15
        # full prefill computes every token, the template's opening included
        prompt = [Segment.fresh(s.token_ids) for s in segments] if name == "full_recompute" else segments
        used = kv_sources(prompt)
        fusor.fuse(prompt, method, DirectLayerKV(used))  # warm-up
        if args.time:
            walls = []
            for _ in range(args.time):
                started = time.perf_counter()
                fusor.fuse(prompt, method, DirectLayerKV(used))
                walls.append(time.perf_counter() - started)
            shown = " ".join(f"{w:.3f}" for w in walls)
            print(f"{name}: median {statistics.median(walls):.3f} s wall over {args.time} ({shown})")
            continue
        started = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof, record_function(name):
            fusor.fuse(prompt, method, DirectLayerKV(used))
        wall = time.perf_counter() - started
        print(f"\n=== {name}: {wall:.3f} s wall (under the profiler) ===")
        averages = prof.key_averages()
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        print(shares(averages))
        if args.trace is not None:
            args.trace.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(args.trace / f"{name}.json"))


if __name__ == "__main__":
    main()
