"""The selected rows as vLLM's kernel attends them: runs of consecutive positions, merged across small gaps.

``merge_gaps`` needs no vLLM; the kernel test does (skipped, saying so, where vLLM is missing).
"""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag.engine.vllm.paged import (
    KERNELS,
    MERGE_GAP,
    AttentionChoice,
    causal_runs,
    merge_gaps,
)


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


class PagedKernel:
    """vLLM's CPU attention kernel on a paged cache of the default model's attention shape: 300 rows
    selected at random among ``n`` positions, blocks of 128 in order."""

    def __init__(self, seed: int, n: int = 2000, block: int = 128) -> None:
        pytest.importorskip("vllm", reason="vLLM's CPU attention kernel needs vLLM (make install-vllm)")
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        from cacheblend_rag.engine.vllm.paged import KernelOptions
        from cacheblend_rag.models.runtime import ModelShape

        self.shape = ModelShape("llama", 1, 576, 9, 3, 64, 100, 8192)
        self.n, self.block, self.blocks = n, block, (n + block - 1) // block
        self.generator = torch.Generator().manual_seed(seed)
        self.positions = torch.randperm(n, generator=self.generator)[:300].sort().values
        self.options = KernelOptions(isa=_get_attn_isa(torch.float32, block, self.shape.head_dim, "auto"))

    def randn(self, *size: int) -> torch.Tensor:
        return torch.randn(*size, generator=self.generator)

    def query(self) -> torch.Tensor:
        return self.randn(self.positions.numel(), self.shape.num_heads, self.shape.head_dim)

    def attend(self, rows: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """``q`` [rows, H, d] at positions ``rows`` as causal runs over ``kv_cache`` (scale 1/8)."""
        from cacheblend_rag.engine.vllm.paged import attend_runs, scheduler_metadata

        starts, seq_lens = causal_runs(rows)
        table = torch.arange(self.blocks, dtype=torch.int32)[None].expand(seq_lens.numel(), -1).contiguous()
        scheduler = scheduler_metadata(self.shape, torch.float32, starts, seq_lens, self.options)
        return attend_runs(q, kv_cache, (starts, seq_lens, table, scheduler), 0.125, self.options)


def test_the_kernel_gives_the_selected_rows_the_same_output_merged_or_not():
    """Each selected row sees the same keys under the same causal mask in a merged run: its output is the
    one its own run gives (zero queries in the gaps change nothing but the rows thrown away)."""
    kernel = PagedKernel(seed=1)
    shape, positions = kernel.shape, kernel.positions
    kv_cache = kernel.randn(kernel.blocks, shape.num_kv_heads, kernel.block, 2 * shape.head_dim)
    query = kernel.query()
    merged = merge_gaps(positions)
    assert merged.numel() > positions.numel()
    where = torch.searchsorted(merged, positions)
    padded = query.new_zeros((merged.numel(), *query.shape[1:])).index_copy_(0, where, query)
    alone = kernel.attend(positions, query, kv_cache)
    together = kernel.attend(merged, padded, kv_cache).index_select(0, where)
    assert (alone - together).abs().max().item() <= 1e-5


def test_auto_keeps_the_kernel_that_attended_fastest_for_each_size():
    choice = AttentionChoice("auto", trials=2)
    keys = 6210  # size class 8192
    # layer 0 warms vLLM's kernel up untimed; then the kernels in turn until each has attended two layers
    turns = [choice.kernel(keys, layer) for layer in range(8)]
    assert turns == ["vllm", *KERNELS, *KERNELS, "vllm"]
    times = {"vllm": 0.071, "vllm_unmerged": 0.088, "runtime": 0.060}
    for layer, kernel in enumerate(turns[:7]):
        assert not choice.chosen
        choice.record(keys, layer, kernel, 9.0 if layer == 0 else times[kernel])
    assert choice.chosen == {8192: "runtime"}
    assert choice.report() == {
        "8192": {"chosen": "runtime", "ms_per_layer": {k: v * 1e3 for k, v in times.items()}}
    }
    assert {choice.kernel(keys, layer) for layer in range(30)} == {"runtime"}
    assert choice.kernel(5000, 7) == "runtime"  # the same size class
    assert choice.kernel(3133, 1) == "vllm" and choice.kernel(3133, 3) == "runtime"  # 4096: undecided
    times = {"vllm": 0.016, "vllm_unmerged": 0.014, "runtime": 0.016}
    for layer in range(1, 7):
        kernel = choice.kernel(3133, layer)
        choice.record(3133, layer, kernel, times[kernel])
    assert choice.chosen == {8192: "runtime", 4096: "vllm_unmerged"}
    for mode in ("vllm", "runtime"):
        fixed = AttentionChoice(mode)
        fixed.record(keys, 1, mode, 1.0)
        assert {fixed.kernel(keys, layer) for layer in range(4)} == {mode} and not fixed.chosen
    with pytest.raises(ValueError, match="'auto', 'vllm' or 'runtime', got 'fast'"):
        AttentionChoice("fast")  # type: ignore[arg-type]


def test_the_runtime_kernel_gives_the_selected_rows_vllms_output():
    """The two kernels AttentionChoice picks between attend a selection alike: our runtime's masked SDPA
    blocks over the K/V laid out contiguously give vLLM's kernel's output over the same K/V written into a
    paged cache by vLLM's own cache update."""
    kernel = PagedKernel(seed=2)
    from types import SimpleNamespace

    from vllm import _custom_ops as ops

    from cacheblend_rag.models.attention import AttentionMask
    from cacheblend_rag.models.runtime import LayerwiseModel

    shape, n, block = kernel.shape, kernel.n, kernel.block
    keys, values = (kernel.randn(1, shape.num_kv_heads, n, shape.head_dim) for _ in "kv")
    kv_cache = torch.zeros(kernel.blocks, shape.num_kv_heads, block, 2 * shape.head_dim)
    key_cache, value_cache = kv_cache.view(kernel.blocks, shape.num_kv_heads, 2 * block, -1).chunk(2, dim=2)
    token_major = [t[0].transpose(0, 1).contiguous() for t in (keys, values)]  # [n, Hkv, d]
    ops.cpu_attn_reshape_and_cache(*token_major, key_cache, value_cache, torch.arange(n), kernel.options.isa)
    query = kernel.query()
    paged = kernel.attend(kernel.positions, query, kv_cache)

    mask = AttentionMask.for_positions(kernel.positions, n)
    assert mask.blocks  # the scattered rows' shape, attended in row blocks
    runtime = SimpleNamespace(attention_token_layers=0, scaling=0.125)
    ours = LayerwiseModel.attend(runtime, query.transpose(0, 1)[None], keys, values, mask)
    assert (ours.view_as(paged) - paged).abs().max().item() <= 1e-5
