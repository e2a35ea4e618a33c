"""How fast vLLM's CPU attention kernel attends a CacheBlend selection, by how its rows are grouped.

    .venv-vllm/bin/python scripts/vllm_attention_runs.py [--chunks 12] [--chunk-tokens 512] [--repeats 10]

The vLLM path (cacheblend_rag/engine/vllm/paged.py) attends the selected rows with
``cpu_attention_with_kv_cache``, one causal "sequence" per run of consecutive selected positions. This
fuses the ``scripts/profile_fusion.py`` prompt with the default method to get a real selection, then times
the kernel per layer (random K/V in a paged cache of the model's shape; median of ``--repeats``) on:

* the runs as selected;
* runs merged across gaps of at most G unselected positions (the gap rows attended too and thrown away:
  fewer, longer runs, more rows);
* every position (full prefill's causal attention), the kernel's best rate;

and, for comparison, our runtime's row blocks over the same selection (the kernel the vLLM path's
``AttentionChoice`` picks instead where it is faster, cacheblend_rag/engine/vllm/paged.py).

It prints each variant's milliseconds per layer and its rate counted on the rows it attends (every row's
keys, 4 * heads * head_dim FLOPs per key). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--chunks", type=int, default=12)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    from profile_fusion import build_prompt
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from cacheblend_rag.blend import DirectLayerKV, Fusor, parse_method
    from cacheblend_rag.blend.segments import kv_sources
    from cacheblend_rag.engine.vllm.paged import (
        KernelOptions,
        attend_runs,
        causal_runs,
        merge_gaps,
        scheduler_metadata,
    )
    from cacheblend_rag.models.attention import AttentionMask
    from cacheblend_rag.models.loader import load_model
    from cacheblend_rag.settings import get_settings

    model = load_model(config=get_settings())
    segments = build_prompt(model, args.chunks, args.chunk_tokens)
    method = parse_method("cacheblend").build()
    fusion = Fusor(model).fuse(segments, method, DirectLayerKV(kv_sources(segments)))
    selected, n = fusion.selected.sort().values.cpu(), fusion.num_tokens
    shape, block = model.shape, 128
    options = KernelOptions(isa=_get_attn_isa(torch.float32, block, shape.head_dim, "auto"))
    blocks = (n + block - 1) // block
    kv_cache = torch.randn(blocks, shape.num_kv_heads, block, 2 * shape.head_dim)
    print(
        f"prompt {n} tokens, {selected.numel()} rows selected, {torch.get_num_threads()} threads, "
        f"kernel isa {options.isa}, split kv {envs.VLLM_CPU_ATTN_SPLIT_KV}"
    )

    def median_ms(attend) -> float:
        """Median milliseconds of ``attend()`` over ``--repeats`` calls after one warm-up call."""
        attend()
        walls = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            attend()
            walls.append(time.perf_counter() - started)
        return 1000 * statistics.median(walls)

    def per_layer_ms(positions: torch.Tensor) -> tuple[float, int]:
        query_start, seq_lens = causal_runs(positions)
        table = torch.arange(blocks, dtype=torch.int32)[None].expand(seq_lens.numel(), -1).contiguous()
        scheduler = scheduler_metadata(shape, torch.float32, query_start, seq_lens, options)
        runs = (query_start, seq_lens, table, scheduler)
        query = torch.randn(positions.numel(), shape.num_heads, shape.head_dim)
        return median_ms(lambda: attend_runs(query, kv_cache, runs, model.scaling, options)), seq_lens.numel()

    variants = [("as selected", selected)]
    variants += [(f"gaps <= {gap} merged", merge_gaps(selected, gap)) for gap in (1, 2, 4, 8, 16)]
    variants.append(("every position (full prefill)", torch.arange(n)))
    print(f"{'rows attended':32s} {'rows':>6s} {'runs':>6s} {'ms/layer':>9s} {'GFLOP/s':>8s}")
    for label, positions in variants:
        ms, runs = per_layer_ms(positions)
        flops = float((positions + 1).sum()) * 4 * shape.num_heads * shape.head_dim
        print(f"{label:32s} {positions.numel():6d} {runs:6d} {ms:9.2f} {flops / ms / 1e6:8.0f}")
    mask = AttentionMask.for_positions(selected, n)
    keys, values = (torch.randn(1, shape.num_kv_heads, n, shape.head_dim) for _ in "kv")
    query = torch.randn(1, shape.num_heads, selected.numel(), shape.head_dim)
    ms = median_ms(lambda: model.attend(query, keys, values, mask))
    flops = float((selected + 1).sum()) * 4 * shape.num_heads * shape.head_dim
    label = f"runtime's row blocks ({len(mask.blocks)})"
    print(f"{label:32s} {selected.numel():6d} {'-':>6s} {ms:9.2f} {flops / ms / 1e6:8.0f}")


if __name__ == "__main__":
    main()
