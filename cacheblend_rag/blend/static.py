"""The static fusion: one request fused by fixed-shape steps the host queues without waiting for the device.

The module-by-module fusion (:mod:`.fusor`'s layer passes) suits the CPU, where a kernel's dispatch is cheap
and every pass over the bytes counts; on an accelerator it leaves the device idle while the host decides
sizes from values it reads back (selection sizes, row-block bounds, per-chunk counts). Here the host plans
everything first (:class:`~.static_layout.StaticLayout`), then runs the probe layers, one top-k, and the
blend layers (:mod:`.static_steps`), each a fixed number of kernels whatever the prompt's chunk count, and
reads back once, after the logits. The result is the same fusion within float error: the same selection
(a device top-k instead of a sort), the same correction, exact causal attention in one call per layer.

Used where the fusor runs on an accelerator (or when asked, e.g. by tests on the CPU), for one request at
a time, for any method whose ``static_selection`` says what it selects; otherwise the fusor keeps the
module-by-module path.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.profiler import record_function

from ..models.fused import FusedWeights, fused_weights
from ..models.runtime import KVCache, LayerwiseModel
from . import static_steps
from .plan import FusionPlan
from .segments import LayerKVProvider
from .static_layout import DeviationNarrowing, HostRows, QueryTopK, StaticLayout, StaticSelection, bucket
from .static_shift import ShiftInputs, shift_scratch, shift_spread, shift_unrotate
from .static_steps import causal_mask, head_tables, place_layers, rerotate

# The most bytes of joined chunk KV staged at once before placing (layers go in groups that fit): placing
# several layers per operation cuts kernels, and the group's decode temporaries stay a few times this.
STAGING_BYTES = 512 << 20

# Called with the layer about to run (and -1 once the logits are out): lets tests and profiles attribute
# the device operations of a fusion to its layers without a second code path.
LayerHook = Callable[[int], None]


class Steps(NamedTuple):
    """The traced steps of a static fusion (plain functions, or each compiled: :func:`compiled_steps`)."""

    probe_layer: Callable
    blend_layer: Callable
    check_layer: Callable
    select_top: Callable
    shift_inputs: Callable


EAGER_STEPS = Steps(
    static_steps.probe_layer,
    static_steps.blend_layer,
    static_steps.check_layer,
    static_steps.select_top,
    static_steps.shift_inputs,
)


@functools.cache
def compiled_steps(mode: str) -> Steps:
    """Every step under ``torch.compile`` with static shapes (one graph per size bucket, shared by all
    layers: a layer's weights are inputs): ``mode`` "eager" traces only (dynamo's checks, no code
    generated), "default" or "reduce-overhead" (CUDA graphs) as torch.compile takes them."""
    # Each method, bucket, last layer and shift on/off is its own graph: a few dozen in a server, more than
    # dynamo's default limit of 8 per step, past which it would silently run the step eagerly.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 512
    )
    if mode == "eager":
        return Steps(*(torch.compile(step, backend="eager", dynamic=False) for step in EAGER_STEPS))
    return Steps(*(torch.compile(step, mode=mode, dynamic=False) for step in EAGER_STEPS))


class StaticFusion:
    """One prompt's static fusion: its layout, cache and rows; :meth:`run` fuses and returns the pieces a
    :class:`~.fusor.FusionResult` is made of.

    :meth:`run` is three parts a graph capture can take apart (:mod:`.static_graph`): :meth:`prepare`
    (everything the host sends, before the first layer), :meth:`compute` (device work alone: it reads
    only tensors this object holds and sizes fixed by the layout's buckets, so a captured replay serves
    any prompt of the same buckets once those tensors hold its values) and :meth:`account` (the host's
    counts).

    The cache is one tensor (:attr:`storage`, [L, 2, 1, Hkv, capacity, d]; :attr:`cache` views it), so a
    layer's K and V are written together and several layers' cached rows are placed by a few operations:
    each group of layers is joined (:meth:`stage_layers`) straight into the cache where the cached rows
    lie back to back, else into a staging buffer placed by one indexed write, and re-rotated together
    before the first of them runs."""

    def __init__(
        self,
        model: LayerwiseModel,
        weights: FusedWeights,
        plan: FusionPlan,
        selection: StaticSelection,
        provider: LayerKVProvider,
        extra_capacity: int,
        shifts: bool,
        hook: LayerHook | None = None,
        steps: Steps = EAGER_STEPS,
    ) -> None:
        self.model, self.weights, self.plan, self.selection = model, weights, plan, selection
        self.provider: LayerKVProvider | None = provider
        self.shifts, self.hook, self.steps = shifts, hook, steps
        self.layout = StaticLayout.build(plan, model.rope, model.dtype, model.device)
        self.extra_capacity = extra_capacity
        # a low-precision model's probe scores by bf16 products with float32 results (static_steps)
        self.fast = model.dtype != torch.float32
        self.checks = dict(selection.checks) if isinstance(selection, DeviationNarrowing) else {}
        if isinstance(selection, QueryTopK):
            self.count = self.layout.fresh + selection.budget
            self.keeps = selection.budget < plan.num_cached
        else:
            self.count = selection.positions.numel()
            self.keeps = self.count < self.layout.fresh + plan.num_cached
        self.cache: KVCache | None = None  # views of :attr:`storage`
        # [L, 2, 1, Hkv, capacity, d]: a new one at prepare, unless a capture lends its own
        self.storage: torch.Tensor | None = None
        # [L, Hkv, 2, Ncb, d]: every layer's cached rows, when a capture stages them all before the compute
        self.staging: torch.Tensor | None = None
        self.inputs: dict[str, torch.Tensor] = {}
        self.load_wait = 0.0
        self.placed = 0  # the first layers, whose cached rows are in the cache already
        self.qkv_counts: list[int] = []
        self.attended_counts: list[int] = []
        self.probe_token_layers = 0
        self.scores: tuple[torch.Tensor, torch.Tensor] | None = None
        self._spread: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._unrotate: torch.Tensor | None = None

    @property
    def final_count(self) -> int:
        """Rows the last layer recomputes: the fresh ones and the last check's budget (or the selection)."""
        return self.layout.fresh + self.checks[max(self.checks)] if self.checks else self.count

    def bucket_key(self) -> tuple:
        """What :meth:`compute` depends on besides its tensors' values: fusions of equal keys can share one
        captured graph."""
        layout, selection = self.layout, self.selection
        if isinstance(selection, QueryTopK):
            chosen = ("query", bucket(selection.budget), selection.score, selection.probe_layers)
        elif isinstance(selection, DeviationNarrowing):
            checks = tuple((layer, bucket(budget)) for layer, budget in self.checks.items())
            chosen = ("deviation", bucket(selection.positions.numel()), checks, selection.signal)
        else:
            chosen = ("rows", bucket(selection.positions.numel()))
        sizes = (layout.keys, layout.fresh_bucket, layout.cached_index.numel(), layout.chunks, layout.span)
        sizes += (layout.scored,)
        return (chosen, sizes, self.shifts and self.keeps and not self.checks, self.model.dtype)

    # -- pieces ---------------------------------------------------------------------------------------

    def _layer_kv(self, layer: int) -> torch.Tensor:
        """The layer's K and V over the slots attention reads: [2, Hkv, Tb, d]."""
        return self.storage[layer, :, 0, :, : self.layout.keys]

    def group_size(self) -> int:
        """Layers staged and placed together (:data:`STAGING_BYTES` of joined chunk KV at most)."""
        shape = self.model.shape
        per_layer = 2 * shape.num_kv_heads * self.layout.cached_index.numel() * shape.head_dim
        per_layer *= torch.empty((), dtype=self.model.dtype).element_size()
        return max(1, min(self.model.num_layers, STAGING_BYTES // max(per_layer, 1)))

    def stage_layers(self, start: int, stop: int, out: torch.Tensor) -> None:
        """Layers ``start``..``stop``-1's cached rows joined into ``out`` [stop - start, Hkv, 2, >= Nc, d]
        (in source order; rows past them left as they are): by the provider's own joined decode where it
        has one (:meth:`~cacheblend_rag.store.joined.JoinedLayerKV.stage`), else one join per side and
        layer of what :meth:`layer` serves (load wait counted)."""
        cached = self.layout.cached
        waited = time.perf_counter()
        stage = getattr(self.provider, "stage", None)
        if stage is not None:
            stage(start, stop, out[:, :, :, :cached])
            self.load_wait += time.perf_counter() - waited
            return
        device = self.model.device
        for i, layer in enumerate(range(start, stop)):
            waited = time.perf_counter()
            parts = self.provider.layer(layer)  # providers serve layers in order; always ask
            self.load_wait += time.perf_counter() - waited
            for side in range(2):
                pieces = [part[side].to(device, non_blocking=True) for part in parts]
                torch.cat(pieces, dim=1, out=out[i, :, side, :cached])

    def _place_through(self, layer: int) -> None:
        """Stage and place the groups of layers up to ``layer`` that are not placed yet: where the cached
        rows lie back to back, joined and re-rotated straight in the cache (no staging buffer, no
        indexed write)."""
        layout, num_layers, shape = self.layout, self.model.num_layers, self.model.shape
        if not layout.cached:
            self.placed = num_layers
        while self.placed <= layer:
            start = self.placed
            stop = min(num_layers, start + self.group_size())
            if layout.cached_start >= 0:
                rows = slice(layout.cached_start, layout.cached_start + layout.cached)
                staged = self.storage[start:stop, :, 0, :, rows].transpose(1, 2)
                self.stage_layers(start, stop, staged)
                rerotate(staged, layout.rerotation)
            else:
                staged = torch.zeros(
                    (stop - start, shape.num_kv_heads, 2, layout.cached_index.numel(), shape.head_dim),
                    dtype=self.model.dtype,
                    device=self.model.device,
                )
                self.stage_layers(start, stop, staged)
                place_layers(self.storage[start:stop], staged, layout.cached_index, layout.rerotation)
            self.placed = stop

    def stage(self) -> None:
        """Every layer's cached rows joined into :attr:`staging` (copies alone: the re-rotation and the
        placing are the compute's, one operation for all layers)."""
        num_layers, size = self.model.num_layers, self.group_size()
        for start in range(0, num_layers, size):
            self._hook(start)
            if self.layout.cached:
                stop = min(num_layers, start + size)
                self.stage_layers(start, stop, self.staging[start:stop])
        self.placed = num_layers

    def _embed(self, rows: torch.Tensor) -> torch.Tensor:
        return self.model.embed(self.layout.token_ids.index_select(0, rows)).to(self.model.dtype)

    def _scalar(self, value) -> torch.Tensor:
        return torch.tensor(value, device=self.model.device)

    def _shift_tables(self) -> None:
        """The chunk-shift correction's tables that depend on the prompt alone (device work of the
        compute: a replay rebuilds them from the tables copied in)."""
        layout, shape, dtype = self.layout, self.model.shape, self.model.dtype
        spread = shift_spread(layout.shift_tables, layout.chunk_index, layout.chunks, dtype)
        scratch = shift_scratch(layout.chunks, shape.num_kv_heads, shape.head_dim, dtype, self.model.device)
        self._spread = (spread, layout.chunk_index, scratch)
        self._unrotate = shift_unrotate(layout.shift_tables)

    def _shift_inputs(self, rows: torch.Tensor, first: int) -> ShiftInputs:
        """The chunk-shift correction of ``rows`` for layers ``first``.. (all placed first)."""
        layout = self.layout
        self._place_through(self.model.num_layers - 1)
        return self.steps.shift_inputs(
            rows,
            self.storage[first:],
            layout.measure_slot,
            layout.chunks,
            self._unrotate,
            self._spread,
            self.model.rope.attention_scaling,
        )

    # -- the fusion -----------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Every number and table the device needs from the host, sent before the first layer."""
        layout, selection, shape = self.layout, self.selection, self.model.shape
        if self.storage is None:
            capacity = max(layout.keys, self.plan.num_tokens + self.extra_capacity)
            # zeroed: padded rows read slots no real row writes, which must hold finite numbers
            self.storage = torch.zeros(
                (shape.num_layers, 2, 1, shape.num_kv_heads, capacity, shape.head_dim),
                dtype=self.model.dtype,
                device=self.model.device,
            )
        self.cache = cache_views(self.storage)
        inputs = {f"check{layer}": self._scalar(budget) for layer, budget in self.checks.items()}
        inputs["last"] = self._scalar([self.final_count - 1])
        if isinstance(selection, QueryTopK):
            inputs["budget"] = self._scalar(selection.budget)
            groups = self.weights.heads // self.weights.kv_heads
            rows = (
                layout.fresh_rows[layout.fresh_bucket - layout.scored :] if self.fast else layout.fresh_rows
            )
            queries = (rows >= layout.first_query) & (rows < layout.num_tokens)
            inputs["query"] = queries.float().repeat(groups)
        else:
            inputs["rows"] = layout.rows(selection.positions)
        self.inputs = inputs

    def _probe(self, top: QueryTopK) -> torch.Tensor:
        """The probe's layers over the fresh rows; returns the rows recomputed after it (the budget's best
        cached ones and the fresh ones)."""
        model, layout, fw = self.model, self.layout, self.weights
        rows = layout.fresh_rows
        hidden, tables = self._embed(rows), head_tables(layout.rope_tables, rows, fw)
        groups = fw.heads // fw.kv_heads
        scored = rows[layout.fresh_bucket - layout.scored :] if self.fast else rows
        masks = (
            causal_mask(scored, layout.keys, torch.float32).repeat(groups, 1)[None],
            causal_mask(rows, layout.keys, model.dtype)[None, None] if self.fast else None,
        )
        masses = torch.empty((top.probe_layers, fw.kv_heads, layout.keys), device=model.device)
        with record_function("fusion::probe"):
            for layer in range(top.probe_layers):
                self._place_through(layer)  # (before the mark: a group's loads are not one layer's)
                self._hook(layer)
                last = layer == top.probe_layers - 1
                hidden = self.steps.probe_layer(
                    fw.layers[layer], fw, hidden, tables, rows, self._layer_kv(layer), masks,
                    self.inputs["query"], masses[layer], finish_layer=not last, fast=self.fast,
                )  # fmt: skip
        # each position's value norm at every probe layer, as that layer's attention saw it
        values = self.storage[: top.probe_layers, 1, 0, :, : layout.keys]
        norms = torch.linalg.vector_norm(values, dim=-1, dtype=torch.float32)
        self.scores = (masses.sum(dim=(0, 1)), (masses * norms).sum(dim=(0, 1)))
        chosen = self.scores[0 if top.score == "attention" else 1]
        size = bucket(top.budget)
        budget = self.inputs["budget"]
        return self.steps.select_top(chosen, layout.candidate_bias, budget, rows, size, layout.dummy)

    @torch.inference_mode()
    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fusion's device work after :meth:`prepare`: the next token's logits [1, V] and the rows the
        last layer recomputed (padded to their bucket)."""
        model, layout, fw, selection, checks = (
            self.model,
            self.layout,
            self.weights,
            self.selection,
            self.checks,
        )
        if self.staging is not None and layout.cached:
            place_layers(self.storage, self.staging, layout.cached_index, layout.rerotation)
        if self.shifts and (self.keeps or checks):
            self._shift_tables()
        rows = self._probe(selection) if isinstance(selection, QueryTopK) else self.inputs["rows"]
        hidden, tables = self._embed(rows), head_tables(layout.rope_tables, rows, fw)
        mask = causal_mask(rows, layout.keys, model.dtype)[None, None]
        shift = self._shift_inputs(rows, 0) if self.shifts and self.keeps and not checks else None
        first = 0  # the layer ``shift`` starts at
        last = model.num_layers - 1
        with record_function("fusion::layers"):
            for layer in range(model.num_layers):
                self._place_through(layer)  # (before the mark: a group's loads are not one layer's)
                self._hook(layer)
                kv = self._layer_kv(layer)
                here = shift.layer(layer - first) if shift is not None else None
                if layer in checks:
                    budget = checks[layer]
                    narrowing = (
                        layout.candidate_bias.index_select(0, rows),
                        layout.fresh_rows,
                        self.inputs[f"check{layer}"],
                        bucket(budget),
                        selection.signal,
                    )
                    hidden, rows, tables, mask = self.steps.check_layer(
                        fw.layers[layer], fw, hidden, tables, rows, kv, narrowing, layout.rope_tables, here
                    )
                    shift, first = None, layer + 1
                    if self.shifts and layer < last:
                        shift = self._shift_inputs(rows, first)
                else:
                    last_row = self.inputs["last"] if layer == last else None
                    hidden = self.steps.blend_layer(
                        fw.layers[layer], fw, hidden, tables, rows, kv, mask, here, last_row
                    )
        self.placed = model.num_layers
        return model.logits(hidden[-1:]), rows

    def account(self) -> None:
        """The host's counts of the work done (the same as the layer passes report)."""
        model, layout, selection = self.model, self.layout, self.selection
        count = self.count
        if isinstance(selection, QueryTopK):
            self.probe_token_layers = layout.fresh * (selection.probe_layers - 1)
            model.qkv_token_layers += layout.fresh * selection.probe_layers
            model.attention_token_layers += self.probe_token_layers
        last = model.num_layers - 1
        for layer in range(model.num_layers):
            self.qkv_counts.append(count)
            if layer in self.checks:
                count = layout.fresh + self.checks[layer]
            self.attended_counts.append(1 if layer == last else count)
        model.qkv_token_layers += sum(self.qkv_counts)
        model.attention_token_layers += sum(self.attended_counts)
        self.cache.length = self.plan.num_tokens

    def recomputed(self, rows: torch.Tensor) -> torch.Tensor:
        """The one read back: which positions the last layer recomputed (on the host)."""
        return rows[: self.final_count].cpu()

    @torch.inference_mode()
    def run(self) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        """Fuse; returns the next token's logits [V] (float32), the recomputed positions of the last layer
        (on the host) and the cache (positions 0..T-1 filled)."""
        self.prepare()
        logits, rows = self.compute()
        self._hook(-1)
        self.account()
        return logits[0], self.recomputed(rows), self.cache

    def _hook(self, layer: int) -> None:
        if self.hook is not None:
            self.hook(layer)


def cache_views(storage: torch.Tensor) -> KVCache:
    """A :class:`KVCache` whose layers are views of one tensor [L, 2, 1, Hkv, capacity, d]."""
    layers = storage.shape[0]
    return KVCache([storage[i, 0] for i in range(layers)], [storage[i, 1] for i in range(layers)])


def static_fusion(
    model: LayerwiseModel,
    plan: FusionPlan,
    method,
    provider: LayerKVProvider,
    extra_capacity: int = 0,
    hook: LayerHook | None = None,
    steps: Steps = EAGER_STEPS,
    selection: StaticSelection | None = None,
) -> StaticFusion | None:
    """A static fusion of ``plan`` with ``method`` (``selection``: the method's static selection, when
    the caller built it already), or None where the model's layers or the method's selection need the
    module-by-module path."""
    weights = fused_weights(model)
    if weights is None:
        return None
    if selection is None:
        selection = method.static_selection(plan, model.num_layers)
    if selection is None:
        return None
    shifts = method.shifts_chunks() and bool(plan.chunk_spans())
    return StaticFusion(model, weights, plan, selection, provider, extra_capacity, shifts, hook, steps)


__all__ = [
    "DeviationNarrowing",
    "HostRows",
    "LayerHook",
    "QueryTopK",
    "StaticFusion",
    "Steps",
    "cache_views",
    "compiled_steps",
    "static_fusion",
]
