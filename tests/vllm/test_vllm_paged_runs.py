"""The selected rows as vLLM's kernel attends them: runs of consecutive positions, merged across small gaps.

``merge_gaps`` needs no vLLM; the kernel test does (skipped, saying so, where vLLM is missing).
"""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag.engine.vllm.paged import MERGE_GAP, causal_runs, merge_gaps


def test_gaps_of_at_most_the_limit_are_filled_and_wider_ones_kept():
    positions = torch.tensor([3, 4, 6, 11, 12, 30, 35])
    # 4 -> 6 (gap 1) and 30 -> 35 (gap 4) filled; 6 -> 11 (gap 4) filled; 12 -> 30 (gap 17) kept
    assert merge_gaps(positions, gap=4).tolist() == [*range(3, 13), *range(30, 36)]
    assert merge_gaps(positions, gap=1).tolist() == [3, 4, 5, 6, 11, 12, 30, 35]
    assert merge_gaps(positions, gap=0).tolist() == positions.tolist()
    assert merge_gaps(torch.tensor([7]), gap=4).tolist() == [7]
    starts, seq_lens = causal_runs(merge_gaps(positions, gap=4))
    assert starts.tolist() == [0, 10, 16] and seq_lens.tolist() == [13, 36]


def test_merged_runs_hold_every_selected_row_in_order():
    generator = torch.Generator().manual_seed(0)
    positions = torch.randperm(4000, generator=generator)[:600].sort().values
    merged = merge_gaps(positions)
    assert bool((merged[1:] > merged[:-1]).all())
    where = torch.searchsorted(merged, positions)
    assert torch.equal(merged[where], positions)
    gaps = merged[1:] - merged[:-1] - 1
    assert int(gaps.max()) > MERGE_GAP and not bool(((gaps > 0) & (gaps <= MERGE_GAP)).any())


def test_the_kernel_gives_the_selected_rows_the_same_output_merged_or_not():
    """Each selected row sees the same keys under the same causal mask in a merged run: its output is the
    one its own run gives (zero queries in the gaps change nothing but the rows thrown away)."""
    pytest.importorskip("vllm", reason="vLLM's CPU attention kernel needs vLLM (make install-vllm)")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from cacheblend_rag.engine.vllm.paged import KernelOptions, attend_runs, scheduler_metadata
    from cacheblend_rag.models.runtime import ModelShape

    shape = ModelShape("llama", 1, 576, 9, 3, 64, 100, 8192)
    block, n = 128, 2000
    generator = torch.Generator().manual_seed(1)
    positions = torch.randperm(n, generator=generator)[:300].sort().values
    options = KernelOptions(isa=_get_attn_isa(torch.float32, block, shape.head_dim, "auto"))
    blocks = (n + block - 1) // block
    kv_cache = torch.randn(blocks, shape.num_kv_heads, block, 2 * shape.head_dim, generator=generator)
    query = torch.randn(positions.numel(), shape.num_heads, shape.head_dim, generator=generator)

    def attend(rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        starts, seq_lens = causal_runs(rows)
        table = torch.arange(blocks, dtype=torch.int32)[None].expand(seq_lens.numel(), -1).contiguous()
        scheduler = scheduler_metadata(shape, torch.float32, starts, seq_lens, options)
        return attend_runs(q, kv_cache, (starts, seq_lens, table, scheduler), 0.125, options)

    merged = merge_gaps(positions)
    assert merged.numel() > positions.numel()
    where = torch.searchsorted(merged, positions)
    padded = query.new_zeros((merged.numel(), *query.shape[1:])).index_copy_(0, where, query)
    alone, together = attend(positions, query), attend(merged, padded).index_select(0, where)
    assert (alone - together).abs().max().item() <= 1e-5
