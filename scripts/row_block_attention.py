"""How fast the runtime attends a real CacheBlend selection's rows, by row-block layout.

    .venv/bin/python scripts/row_block_attention.py [--chunks 6 12] [--chunk-tokens 512] [--repeats 12]

For each prompt (``--chunks`` MuSiQue chunks of ``--chunk-tokens`` tokens, as scripts/profile_fusion.py
builds it) the default cacheblend selects its rows; one layer's attention of those rows (random q/k/v of
the model's shape: the time does not depend on the values) is then timed, interleaved, median of
``--repeats``:

* ``masked xN``: N row blocks, each one masked SDPA call over the keys up to its last row (grouped-query
  heads through ``enable_gqa``): what the runtime did before, with N = 16;
* ``split xN``: N row blocks, each the keys before its first row unmasked plus its window masked, merged by
  log-sum-exp, query heads packed as rows (``models.attention.row_block_attention``; the runtime's choice
  of N is ``ATTENTION_ROW_BLOCKS`` / ``ATTENTION_BLOCK_ROWS``).

Prints milliseconds per layer and the useful GFLOP/s (each row's q.k and p.v over the keys it sees).
Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from profile_fusion import build_prompt  # scripts/ is on sys.path when a script in it runs

from cacheblend_rag.blend import DirectLayerKV, Fusor, parse_method
from cacheblend_rag.blend.segments import kv_sources
from cacheblend_rag.models.attention import (
    AttentionMask,
    masked_block_attention,
    row_block_attention,
    row_blocks,
)
from cacheblend_rag.models.loader import load_model
from cacheblend_rag.settings import get_settings


def with_blocks(mask: AttentionMask, positions: torch.Tensor, count: int) -> AttentionMask:
    """``mask`` with its rows cut into ``count`` equal blocks."""
    return AttentionMask(mask.tensor, False, row_blocks(positions, count))


def masked_blocks(q, keys, values, mask: AttentionMask, scaling: float) -> torch.Tensor:
    """Every block one masked SDPA call (the runtime's layout before the split, and on CUDA)."""
    return torch.cat([masked_block_attention(q, keys, values, mask, b, scaling) for b in mask.blocks], dim=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--chunks", type=int, nargs="+", default=[6, 12])
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    model = load_model(config=get_settings())
    shape = model.shape
    generator = torch.Generator().manual_seed(0)
    for chunks in args.chunks:
        segments = build_prompt(model, chunks, args.chunk_tokens)
        method = parse_method("cacheblend").build()
        result = Fusor(model).fuse(segments, method, DirectLayerKV(kv_sources(segments)))
        positions, n = result.selected.cpu(), result.plan.num_tokens
        base = AttentionMask.for_positions(positions, n)
        q = torch.randn(1, shape.num_heads, positions.numel(), shape.head_dim, generator=generator)
        keys = torch.randn(1, shape.num_kv_heads, n, shape.head_dim, generator=generator)
        values = torch.randn(1, shape.num_kv_heads, n, shape.head_dim, generator=generator)
        groups = shape.num_heads // shape.num_kv_heads
        variants = {f"masked x{c}": (masked_blocks, with_blocks(base, positions, c)) for c in (16, 8)}
        variants |= {
            f"split x{c}": (row_block_attention, with_blocks(base, positions, c)) for c in (4, 6, 8, 12)
        }
        variants[f"runtime ({len(base.blocks)} blocks)"] = (row_block_attention, base)
        reference = masked_blocks(q, keys, values, with_blocks(base, positions, 16), model.scaling)
        for fn, mask in variants.values():  # masks built and kernels warmed before the clock
            mask.windows(q.dtype, groups)
            error = float((fn(q, keys, values, mask, model.scaling) - reference).abs().max())
            assert error < 1e-4, error
        seconds: dict[str, list[float]] = {label: [] for label in variants}
        for _ in range(args.repeats):
            for label, (fn, mask) in variants.items():
                started = time.perf_counter()
                fn(q, keys, values, mask, model.scaling)
                seconds[label].append(time.perf_counter() - started)
        useful = float((positions + 1).sum()) * shape.num_heads * shape.head_dim * 4
        threads = torch.get_num_threads()
        print(f"{chunks} x {args.chunk_tokens}: {positions.numel()} rows of {n} positions, {threads} threads")
        for label, times in seconds.items():
            ms = 1e3 * statistics.median(times)
            print(f"  {label:22s} {ms:7.1f} ms per layer  {useful / ms / 1e6:6.0f} GFLOP/s")


if __name__ == "__main__":
    main()
