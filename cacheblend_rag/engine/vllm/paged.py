"""The fused rows attended by vLLM's own attention kernel, over the request's blocks of vLLM's paged cache.

The fusor recomputes scattered rows (a CacheBlend selection) that each attend over the keys before them.
Our runtime attends them over its own cache in row blocks (keys before a block unmasked, its window
masked); vLLM's CPU attention kernel (``cpu_attention_with_kv_cache``) attends variable-length causal
query runs over a block table. So at every layer, once the fusion's K/V of that layer is
final (the cached chunks placed, the selected rows' fresh K/V written over them, which
``LayerwiseModel.attend`` is always called after), :class:`PagedLayerwiseModel`

1. writes that layer's K/V of the request's positions into vLLM's paged cache through the backend's own
   ``do_kv_cache_update`` (the K/V the connector would write after the fusion: written once, in place);
2. attends the selected rows with vLLM's kernel: each run of consecutive positions ``[a, b)`` is one
   causal "sequence" of ``b`` keys whose last ``b - a`` positions are queries, all over the request's
   block table. Runs a few unselected positions apart are attended as one (:func:`merge_gaps`; the rows
   in between get zero queries and their outputs are dropped): the kernel reads a sequence's keys once
   per run, so fewer, longer runs attend faster until the extra rows cost more than that saves. The
   runs, their lengths and the kernel's scheduler metadata are the same at every layer of one
   selection, so they are built once per selection.

Which kernel attends a scattered selection fastest depends on the processor and the prompt's size: on an
Intel Xeon with AMX our runtime's row blocks attend a 12 x 512 selection faster than vLLM's kernel even
after merging (``scripts/vllm_attention_runs.py`` at 929a489: 63.8 against 73.1 ms per layer) while vLLM's
kernel over the runs as selected is the fastest at 6 x 512; on an AMD EPYC vLLM's kernel was almost twice as
fast as ours. :class:`AttentionChoice` therefore times the candidates on the first selections of each size
in this process (its layers take them in turn; each layer is attended once, by one kernel) and keeps the
fastest; the other shapes (a full causal prefill, a suffix, the last layer's one row) always take vLLM's
kernel. Either way the layer's K/V are written into the paged cache first.

Only vLLM's CPU backend is driven so; on another backend (CUDA), or outside a connector load (chunk
precompute), attention is our runtime's and the connector writes the fused K/V after the fusion.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from ...models.attention import AttentionMask
from ...models.runtime import QKV, LayerwiseModel, ModelShape

log = logging.getLogger(__name__)

FusionAttention = Literal["auto", "vllm", "runtime"]


def is_cpu_attention(layer: Any) -> bool:
    """Whether ``layer`` (a vLLM ``Attention`` module) runs vLLM's CPU attention backend."""
    impl = getattr(layer, "impl", None)
    return type(impl).__name__ == "CPUAttentionBackendImpl" and hasattr(layer, "isa")


@dataclass
class PagedTarget:
    """One request's blocks in vLLM's paged cache: the fusion writes positions [start, num_tokens) of
    every layer there (positions before ``start`` are vLLM's prefix-cache hits, already in place)."""

    layers: list[Any]  # vLLM's attention modules, in layer order
    block_ids: list[int]
    block_size: int
    start: int
    num_tokens: int
    written: set[int] = field(default_factory=set)  # layers whose K/V went into the paged cache
    kernels: Counter[str] = field(default_factory=Counter)  # layers attended, by kernel (KERNELS)
    _slots: torch.Tensor | None = None
    _blocks: torch.Tensor | None = None
    _runs: tuple[AttentionMask, dict[int, Any]] | None = None  # a selection's kernel inputs by gap

    def slots(self) -> torch.Tensor:
        if self._slots is None:
            positions = torch.arange(self.start, self.num_tokens)
            blocks = torch.tensor(self.block_ids, dtype=torch.long)
            self._slots = blocks[positions // self.block_size] * self.block_size + positions % self.block_size
        return self._slots

    def block_table(self, rows: int) -> torch.Tensor:
        if self._blocks is None:
            self._blocks = torch.tensor(self.block_ids, dtype=torch.int32)[None]
        return self._blocks.expand(rows, -1).contiguous()


def mask_positions(mask: AttentionMask, rows: int, key_length: int) -> torch.Tensor | None:
    """The query positions an :class:`AttentionMask` over ``key_length`` keys was built for (None when
    they are not strictly ascending, which the kernel's causal runs cannot express)."""
    if mask.is_causal:
        return torch.arange(key_length)
    if mask.suffix_start is not None:
        return torch.arange(mask.suffix_start, key_length)
    if mask.tensor is None:  # every query at the last slot: one row is one run
        return torch.full((rows,), key_length - 1) if rows == 1 else None
    if mask.tensor.shape[0] != 1:
        return None
    positions = mask.tensor[0, 0].sum(-1) - 1  # a row at p sees keys 0..p
    ascending = positions.numel() < 2 or bool((positions[1:] > positions[:-1]).all())
    return positions if ascending else None


# Runs of selected rows at most this many unselected positions apart are attended as one run.
# scripts/vllm_attention_runs.py (at 929a489), the default's 957 rows of a 12 x 512 prompt, ms per layer as
# selected / gaps <= 2 / <= 4 / <= 8 merged: 56-58 / 52 / 53 / 58-60 on an AMD EPYC, 77.1 / 67.6 / 64.9 / 68.5
# on an Intel Xeon with AMX (2026-12-03): 4 is the best or near it on both.
MERGE_GAP = 4


def merge_gaps(positions: torch.Tensor, gap: int = MERGE_GAP) -> torch.Tensor:
    """Ascending ``positions`` with every gap of at most ``gap`` positions between two of them filled in."""
    if positions.numel() < 2 or gap <= 0:
        return positions
    first = int(positions[0])
    steps = positions[1:] - positions[:-1]
    fill = (steps > 1) & (steps <= gap + 1)
    # +1 where a filled gap opens, -1 where it closes: a running sum > 0 inside one
    edges = torch.zeros(int(positions[-1]) - first + 2, dtype=torch.long)
    edges.index_add_(0, positions[:-1][fill] + 1 - first, torch.ones(int(fill.sum()), dtype=torch.long))
    edges.index_add_(0, positions[1:][fill] - first, torch.full((int(fill.sum()),), -1, dtype=torch.long))
    covered = edges.cumsum(0)[:-1] > 0
    covered[positions - first] = True
    return covered.nonzero().squeeze(1) + first


def causal_runs(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending ``positions`` as runs of consecutive positions: (query start offsets [R + 1], sequence
    lengths [R]) in the kernel's int32, a run [a, b) being b keys whose last b - a are queries."""
    breaks = (positions[1:] != positions[:-1] + 1).nonzero().squeeze(1) + 1
    ends = torch.cat([breaks, torch.tensor([positions.numel()])])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), ends])
    return starts.to(torch.int32), (positions[ends - 1] + 1).to(torch.int32)


@dataclass(frozen=True)
class KernelOptions:
    """What vLLM's CPU attention kernel takes from an attention layer besides the tensors."""

    isa: str
    sliding_window: int = -1
    softcap: float = 0.0
    sinks: torch.Tensor | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    kv_cache_dtype: str = "auto"

    @classmethod
    def of(cls, layer: Any) -> KernelOptions:
        """The options of ``layer``, a vLLM ``Attention`` module on the CPU backend."""
        impl = layer.impl
        return cls(
            isa=layer.isa,
            sliding_window=impl.sliding_window,
            softcap=impl.logits_soft_cap,
            sinks=impl.sinks,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=impl.kv_cache_dtype,
        )


def scheduler_metadata(
    shape: ModelShape,
    dtype: torch.dtype,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    options: KernelOptions,
) -> torch.Tensor:
    """The kernel's work split for causal runs (:func:`causal_runs`) of a model of ``shape``."""
    from vllm import _custom_ops as ops
    from vllm import envs

    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.numel(),
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=query_start,
        causal=True,
        sliding_window_size=options.sliding_window,
        isa=options.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        kv_cache_dtype=options.kv_cache_dtype,
    )


def attend_runs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    runs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    options: KernelOptions,
) -> torch.Tensor:
    """vLLM's CPU kernel: ``query`` [S, H, d] (token-major) as causal runs over one layer's paged
    ``kv_cache`` [blocks, Hkv, block_size, 2 * d]; ``runs`` = (query starts, sequence lengths, block
    table, scheduler metadata). Returns the output [S, H, d]."""
    from vllm import _custom_ops as ops

    query_start, seq_lens, blocks, scheduler = runs
    num_blocks, kv_heads, block_size, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(num_blocks, kv_heads, block_size * 2, -1).chunk(2, dim=2)
    output = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=output,
        query_start_loc=query_start,
        seq_lens=seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=options.sliding_window,
        block_table=blocks,
        softcap=options.softcap,
        scheduler_metadata=scheduler,
        s_aux=options.sinks,
        k_scale=options.k_scale,
        v_scale=options.v_scale,
        kv_cache_dtype=options.kv_cache_dtype,
    )
    return output


# The kernels a scattered selection may be attended with: vLLM's over runs merged across gaps of at most
# MERGE_GAP, vLLM's over the runs as selected, our runtime's row blocks (models.attention.RowBlock)
KERNELS = ("vllm", "vllm_unmerged", "runtime")
RUN_GAPS = {"vllm": MERGE_GAP, "vllm_unmerged": 0}


@dataclass
class AttentionChoice:
    """Which kernel attends a fusion's scattered rows: ``"vllm"`` (vLLM's paged kernel, runs merged
    across small gaps), ``"runtime"`` (our runtime's row blocks over the fusion's own copy of the
    K/V), or ``"auto"``: the fastest of :data:`KERNELS` on this processor, timed on real fusions. For each
    size (key length, to a power of two) the first selections' layers take the kernels in turn after an
    untimed first layer, until each has attended ``trials`` layers (a selection's layers all do the same
    work); the kernel with the smallest total is kept for that size in this process, so answers stay
    reproducible within it once chosen."""

    mode: FusionAttention = "auto"
    trials: int = 3
    chosen: dict[int, str] = field(default_factory=dict)
    seconds: dict[int, dict[str, list[float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in get_args(FusionAttention):
            raise ValueError(f"fusion attention must be 'auto', 'vllm' or 'runtime', got {self.mode!r}")
        if self.trials < 1:
            raise ValueError(f"AttentionChoice needs at least one trial per kernel, got {self.trials}")

    @staticmethod
    def size(key_length: int) -> int:
        """The size class of a fusion over ``key_length`` keys (the power of two at or above it)."""
        return 1 << max(key_length - 1, 0).bit_length()

    def kernel(self, key_length: int, layer: int) -> str:
        """The kernel to attend layer ``layer`` of a selection over ``key_length`` keys."""
        if self.mode != "auto":
            return self.mode
        found = self.chosen.get(self.size(key_length))
        if found is not None:
            return found
        # layer 0 (untimed) warms vLLM's kernel up; then the kernels in turn
        return KERNELS[(layer - 1) % len(KERNELS)] if layer else KERNELS[0]

    def report(self) -> dict[str, Any]:
        """For each size class timed: the kernel chosen (None while undecided) and each kernel's mean
        milliseconds per layer over its trials."""
        return {
            str(size): {
                "chosen": self.chosen.get(size),
                "ms_per_layer": {
                    name: round(1e3 * sum(times) / len(times), 2) for name, times in timed.items() if times
                },
            }
            for size, timed in self.seconds.items()
        }

    def record(self, key_length: int, layer: int, kernel: str, seconds: float) -> None:
        """Count one layer's attention time while the kernel for this size is undecided."""
        size = self.size(key_length)
        if self.mode != "auto" or layer == 0 or size in self.chosen:
            return
        timed = self.seconds.setdefault(size, {name: [] for name in KERNELS})
        timed[kernel].append(seconds)
        if all(len(times) >= self.trials for times in timed.values()):
            per_layer = {name: 1e3 * sum(times[: self.trials]) / self.trials for name, times in timed.items()}
            self.chosen[size] = min(per_layer, key=per_layer.__getitem__)
            log.info(
                "fusion attention over up to %d keys: %s (ms per layer: %s)",
                size,
                self.chosen[size],
                ", ".join(f"{name} {ms:.1f}" for name, ms in per_layer.items()),
            )


class PagedLayerwiseModel(LayerwiseModel):
    """A :class:`LayerwiseModel` that, while a :class:`PagedTarget` is set (one connector load), writes
    each layer's fused K/V into vLLM's paged cache and attends the fused rows with vLLM's kernel (or, for a
    scattered selection, with our runtime's where :class:`AttentionChoice` finds that faster)."""

    target: PagedTarget | None = None
    _layer = 0

    def __init__(self, *args: Any, attention: FusionAttention = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attention_choice = AttentionChoice(attention)

    def project_qkv(self, layer: int, hidden, positions, cos_sin=None) -> QKV:
        self._layer = layer  # attend() of this layer comes next (blend/layers.run_layer)
        return super().project_qkv(layer, hidden, positions, cos_sin)

    @torch.inference_mode()
    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        target = self.target
        if target is None or q.shape[0] != 1 or keys.shape[2] != target.num_tokens:
            return super().attend(q, keys, values, mask)  # not the request's fusion (a chunk precompute)
        layer = target.layers[self._layer]
        if not mask.blocks:  # a causal prefill, a suffix or one row: vLLM's kernel
            runs = self._runs(target, mask, q.shape[2], keys.shape[2], layer, MERGE_GAP)
            if runs is None:
                return super().attend(q, keys, values, mask)
            self._write(target, layer, keys, values)
            target.kernels["vllm"] += 1
            return self._attend_paged(q, layer, runs)
        choice = self.attention_choice
        kernel = choice.kernel(target.num_tokens, self._layer)
        # what each kernel builds once per selection is built before the clock starts
        runs = None
        if kernel != "runtime":
            runs = self._runs(target, mask, q.shape[2], keys.shape[2], layer, RUN_GAPS[kernel])
        else:
            self.prepare_mask(mask, q, keys)
        self._write(target, layer, keys, values)
        started = time.perf_counter()
        out = super().attend(q, keys, values, mask) if runs is None else self._attend_paged(q, layer, runs)
        used = kernel if runs is not None else "runtime"
        choice.record(target.num_tokens, self._layer, used, time.perf_counter() - started)
        target.kernels[used] += 1
        return out

    def _attend_paged(self, q: torch.Tensor, layer: Any, runs) -> torch.Tensor:
        """``q``'s rows attended by vLLM's kernel over the request's paged cache."""
        kernel_runs, rows, attended = runs
        query = q[0].transpose(0, 1)  # [S, H, d], token-major as vLLM's forward has it
        if rows is None:
            query = query.contiguous()
        else:  # the merged runs' rows: the selected ones' queries, zeros in the gaps between them
            query = query.new_zeros((attended, *query.shape[1:])).index_copy_(0, rows, query)
        output = attend_runs(query, layer.kv_cache, kernel_runs, self.scaling, KernelOptions.of(layer))
        if rows is not None:
            output = output.index_select(0, rows)
        self.attention_token_layers += q.shape[2]
        return output.view(1, q.shape[2], -1)

    def _runs(
        self, target: PagedTarget, mask: AttentionMask, rows: int, key_length: int, layer: Any, gap: int
    ):
        """The kernel's inputs for ``mask``'s rows with runs merged across gaps of at most ``gap``, built
        once per selection (one mask serves its layers): (kernel runs, where the selected rows sit among
        the merged runs' rows or None when every row is selected, how many rows the merged runs hold)."""
        if target._runs is None or target._runs[0] is not mask:
            target._runs = (mask, {})
        built = target._runs[1]
        if gap in built:
            return built[gap]
        positions = mask_positions(mask, rows, key_length)
        if positions is None or positions.numel() != rows:
            built[gap] = None
            return None
        positions = positions.cpu()
        attended = merge_gaps(positions, gap)
        query_start, seq_lens = causal_runs(attended)
        options = KernelOptions.of(layer)
        scheduler = scheduler_metadata(self.shape, self.dtype, query_start, seq_lens, options)
        kernel_runs = (query_start, seq_lens, target.block_table(seq_lens.numel()), scheduler)
        where = None
        if attended.numel() != positions.numel():
            where = torch.searchsorted(attended, positions).to(target.layers[0].kv_cache.device)
        runs = (kernel_runs, where, attended.numel())
        built[gap] = runs
        return runs

    def _write(self, target: PagedTarget, layer: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
        """This layer's K/V of positions [start, T) into the request's blocks (final once attend runs)."""
        if self._layer in target.written:
            return
        kv_cache = layer.kv_cache
        span = slice(target.start, target.num_tokens)
        # [Hkv, n, d] -> [n, Hkv, d], the token-major shape the backend's cache update takes
        k = keys[0, :, span].transpose(0, 1).to(kv_cache.dtype).contiguous()
        v = values[0, :, span].transpose(0, 1).to(kv_cache.dtype).contiguous()
        layer.impl.do_kv_cache_update(layer, k, v, kv_cache, target.slots().to(kv_cache.device))
        target.written.add(self._layer)
