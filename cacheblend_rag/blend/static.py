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
from .probe import query_positions
from .segments import LayerKVProvider
from .static_layout import DeviationNarrowing, HostRows, QueryTopK, StaticLayout, StaticSelection, bucket
from .static_steps import ShiftInputs, causal_mask, place, place_layers

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
    counts)."""

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
        self.checks = dict(selection.checks) if isinstance(selection, DeviationNarrowing) else {}
        if isinstance(selection, QueryTopK):
            self.count = self.layout.fresh + selection.budget
            self.keeps = selection.budget < plan.num_cached
        else:
            self.count = selection.positions.numel()
            self.keeps = self.count < self.layout.fresh + plan.num_cached
        self.cache: KVCache | None = None  # a new one at prepare, unless a capture lends its own
        self.inputs: dict[str, torch.Tensor] = {}
        self.load_wait = 0.0
        self.placed = 0  # the first layers, whose cached rows are in the cache already
        self.pad: tuple[torch.Tensor, torch.Tensor] | None = None
        self.qkv_counts: list[int] = []
        self.attended_counts: list[int] = []
        self.probe_token_layers = 0
        self.scores: tuple[torch.Tensor, torch.Tensor] | None = None
        # a captured fusion's cache as one tensor [L, 2, 1, Hkv, Tb, d], and its staging buffer
        # [L, 2, Hkv, Ncb, d]: :meth:`stage` joins each layer's cached rows there, and the compute places
        # them all (:func:`~.static_steps.place_layers`)
        self.storage: torch.Tensor | None = None
        self.staging: torch.Tensor | None = None

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
        sizes = (layout.keys, layout.fresh_bucket, layout.cached_index.numel(), layout.chunks)
        return (chosen, sizes, self.shifts and self.keeps and not self.checks, self.model.dtype)

    # -- pieces ---------------------------------------------------------------------------------------

    def _layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.layout.keys
        return self.cache.keys[layer][0, :, :keys], self.cache.values[layer][0, :, :keys]

    def _load(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The layer's cached K and V, one of each per source run, on the device (load wait counted)."""
        waited = time.perf_counter()
        parts = self.provider.layer(layer)  # providers serve layers in order; always ask
        self.load_wait += time.perf_counter() - waited
        device = self.model.device
        keys = [k.to(device, non_blocking=True) for k, _ in parts]
        return keys, [v.to(device, non_blocking=True) for _, v in parts]

    def _place(self, layer: int) -> None:
        """The layer's cached rows, joined into one padded tensor (one join whatever the chunk count)."""
        layout = self.layout
        if not layout.cached:
            return
        keys, values = self._load(layer)
        if self.pad is None:
            missing = layout.cached_index.numel() - layout.cached
            first_k, first_v = keys[0], values[0]
            self.pad = (
                first_k.new_zeros((first_k.shape[0], missing, first_k.shape[2])),
                first_v.new_zeros((first_v.shape[0], missing, first_v.shape[2])),
            )
        chunk_k, chunk_v = torch.cat([*keys, self.pad[0]], dim=1), torch.cat([*values, self.pad[1]], dim=1)
        place(*self._layer_cache(layer), chunk_k, chunk_v, layout.cached_index, layout.rerotation)

    def stage(self) -> None:
        """Every layer's cached rows joined into :attr:`staging` (copies alone: the re-rotation and the
        placing are the compute's, one operation for all layers)."""
        cached = self.layout.cached
        for layer in range(self.model.num_layers):
            self._hook(layer)
            if not cached:
                continue
            for side, parts in enumerate(self._load(layer)):
                self.staging[layer, side, :, :cached].copy_(torch.cat(parts, dim=1))
        self.placed = self.model.num_layers

    def _tables(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin_signed = self.layout.rope_tables
        return cos.index_select(0, rows), sin_signed.index_select(0, rows)

    def _shift_inputs(self, rows: torch.Tensor) -> ShiftInputs:
        layout = self.layout
        dtype = self.model.dtype
        cos, sin_signed = layout.shift_tables
        return self.steps.shift_inputs(
            rows,
            layout.measure_slot,
            layout.move_slot,
            layout.chunks,
            self.inputs["no_chunk"],
            layout.shift_tables,
            (cos.to(dtype), sin_signed.to(dtype)),
        )

    def _embed(self, rows: torch.Tensor) -> torch.Tensor:
        return self.model.embed(self.layout.token_ids.index_select(0, rows)).to(self.model.dtype)

    def _scalar(self, value) -> torch.Tensor:
        return torch.tensor(value, device=self.model.device)

    # -- the fusion -----------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Every number and table the device needs from the host, sent before the first layer."""
        layout, selection = self.layout, self.selection
        if self.cache is None:
            capacity = max(layout.keys, self.plan.num_tokens + self.extra_capacity)
            # zeroed: padded rows read slots no real row writes, which must hold finite numbers
            self.cache = self.model.new_cache(capacity, zeroed=True)
        inputs = {f"check{layer}": self._scalar(budget) for layer, budget in self.checks.items()}
        inputs["last"] = self._scalar([self.final_count - 1])
        inputs["no_chunk"] = self._scalar(layout.no_chunk)
        if isinstance(selection, QueryTopK):
            inputs["budget"] = self._scalar(selection.budget)
            groups = self.weights.heads // self.weights.kv_heads
            first_query = int(query_positions(self.plan)[0])
            rows = layout.fresh_rows
            inputs["query"] = ((rows >= first_query) & (rows < layout.num_tokens)).float().repeat(groups)
        else:
            inputs["rows"] = layout.rows(selection.positions)
        self.inputs = inputs

    def _probe(self, top: QueryTopK) -> torch.Tensor:
        """The probe's layers over the fresh rows; returns the rows recomputed after it (the budget's best
        cached ones and the fresh ones)."""
        model, layout, fw = self.model, self.layout, self.weights
        rows = layout.fresh_rows
        hidden, tables = self._embed(rows), self._tables(rows)
        groups = fw.heads // fw.kv_heads
        mask = causal_mask(rows, layout.keys, torch.float32).repeat(groups, 1)[None]
        scores = tuple(torch.zeros(fw.kv_heads, layout.keys, device=model.device) for _ in range(2))
        with record_function("fusion::probe"):
            for layer in range(top.probe_layers):
                self._hook(layer)
                if layer >= self.placed:
                    self._place(layer)
                last = layer == top.probe_layers - 1
                hidden = self.steps.probe_layer(
                    fw.layers[layer], fw, hidden, tables, rows, *self._layer_cache(layer), mask,
                    self.inputs["query"], scores, finish_layer=not last,
                )  # fmt: skip
        attention, contribution = scores
        self.scores = (attention.sum(dim=0), contribution.sum(dim=0))
        chosen = self.scores[0 if top.score == "attention" else 1]
        size = bucket(top.budget)
        budget = self.inputs["budget"]
        return self.steps.select_top(chosen, layout.candidate_bias, budget, rows, size, layout.dummy)

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
        if isinstance(selection, QueryTopK):
            rows = self._probe(selection)
            placed = max(self.placed, selection.probe_layers)
        else:
            rows, placed = self.inputs["rows"], self.placed
        hidden, tables = self._embed(rows), self._tables(rows)
        mask = causal_mask(rows, layout.keys, model.dtype)[None, None]
        shift = self._shift_inputs(rows) if self.shifts and self.keeps and not checks else None
        last = model.num_layers - 1
        with record_function("fusion::layers"):
            for layer in range(model.num_layers):
                self._hook(layer)
                if layer >= placed:
                    self._place(layer)
                keys, values = self._layer_cache(layer)
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
                        fw.layers[layer],
                        fw,
                        hidden,
                        tables,
                        rows,
                        keys,
                        values,
                        narrowing,
                        layout.rope_tables,
                        shift,
                    )
                    shift = self._shift_inputs(rows) if self.shifts else None
                else:
                    last_row = self.inputs["last"] if layer == last else None
                    hidden = self.steps.blend_layer(
                        fw.layers[layer], fw, hidden, tables, rows, keys, values, mask, shift, last_row
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


def static_fusion(
    model: LayerwiseModel,
    plan: FusionPlan,
    method,
    provider: LayerKVProvider,
    extra_capacity: int = 0,
    hook: LayerHook | None = None,
    steps: Steps = EAGER_STEPS,
) -> StaticFusion | None:
    """A static fusion of ``plan`` with ``method``, or None where the model's layers or the method's
    selection need the module-by-module path."""
    weights = fused_weights(model)
    if weights is None:
        return None
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
    "compiled_steps",
    "static_fusion",
]
