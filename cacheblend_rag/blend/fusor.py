"""The fusor: turn independently precomputed chunk KV plus fresh text into one KV cache for the prompt.

1. lay the segments out; each cached chunk's keys are re-rotated (float64 angles, tables built once per
   fusion: :mod:`.placement`) from its own positions 0..n-1 to where it lands in the prompt;
2. a method that selects by the question's attention gets a probe pass first (:mod:`.probe`), which also
   places the cached KV of every layer it runs (all, unless the method's ``probe_layers`` says fewer);
3. layer 0 runs for the positions the method picks (fresh text plus its selection, or every token for
   HKVD); at a check layer the method compares fresh and cached K/V and narrows the set; only selected
   tokens attend and run the MLP, with an exact causal mask over the layer's full-length K/V;
4. every other position keeps its cached K/V, so the resulting cache is the cached KV with the
   recomputed tokens' K/V written over it; generation continues from it like from a full prefill.

Several requests can be fused together (:meth:`Fusor.fuse_many`): per layer their tokens share one
projection and one MLP, each attends over its own cache (:mod:`.layers`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch.profiler import record_function

from ..errors import ContextLengthError, FusionInputError
from ..models.attention import AttentionMask
from ..models.fused import fused_weights
from ..models.runtime import LayerwiseModel
from .fusion import (
    AttentionObserver,
    FusionPath,
    FusionRequest,
    FusionResult,
    FusionRoute,
    PendingKV,
    RoundShare,
)
from .layers import LayerPass, run_layer
from .methods import FullReuse, RecomputeMethod
from .placement import CachedPlacement
from .plan import FusionPlan, LayerState
from .probe import ProbePass, ProbeResult
from .segments import DirectLayerKV, LayerKVProvider, Segment, kv_sources
from .shift import ChunkShift
from .static import EAGER_STEPS, LayerHook, compiled_steps, static_fusion
from .static_graph import GRAPHS, FusionGraphs

__all__ = [
    "AttentionObserver",
    "FusionPath",
    "FusionRequest",
    "FusionResult",
    "FusionRoute",
    "Fusor",
    "PendingKV",
    "RoundShare",
]

# the method a probe-only run carries (it never selects: the probe computes the fresh text alone)
_PROBE_ONLY = FullReuse()


class Fusor:
    """Applies :class:`RecomputeMethod` s layer by layer on a :class:`LayerwiseModel`.

    Each request is routed once (:meth:`route`): its plan built, and where the fusor runs the static steps
    and the method has a static selection, that selection built, so the request takes the static steps
    (blend/static.py: queued by the host without reading anything back); otherwise the module-by-module
    layer passes, several requests in one pass. ``static``: whether the static steps run (default: where
    the model runs on an accelerator; the layer passes are faster on the CPU); the model's layer weights
    are packed for them here, once. ``compile_mode``: the static steps under ``torch.compile`` in that
    mode (:func:`~.static.compiled_steps`; None: as they are), or "graphs": each static fusion replayed as
    a CUDA graph per size bucket (:mod:`.static_graph`). ``layer_hook`` is called before each layer of a
    static fusion (and with -1 after its logits)."""

    def __init__(
        self,
        model: LayerwiseModel,
        static: bool | None = None,
        compile_mode: str | None = None,
        layer_hook: LayerHook | None = None,
    ) -> None:
        self.model = model
        self.static = model.device.type != "cpu" if static is None else static
        # packed when the engine is built, not while a request waits (None: a model the steps cannot run)
        self.weights = fused_weights(model) if self.static else None
        # "graphs": each static fusion's compute replayed as one CUDA graph per bucket (static_graph.py);
        # any other mode compiles the steps (torch.compile's modes)
        self.graphs = FusionGraphs(model) if compile_mode == GRAPHS and self.weights is not None else None
        self.steps = compiled_steps(compile_mode) if compile_mode not in (None, GRAPHS) else EAGER_STEPS
        self.layer_hook = layer_hook

    def validate(self, segments: list[Segment]) -> None:
        shape = self.model.shape
        for i, segment in enumerate(segments):
            kv = segment.kv
            if kv is None:
                continue
            if kv.fingerprint != self.model.fingerprint:
                raise FusionInputError(
                    f"segment {i} ({segment.chunk_id or 'unnamed chunk'}): KV was computed by another model "
                    f"(fingerprint {kv.fingerprint[:12]}…, this model {self.model.fingerprint[:12]}…)"
                )
            if kv.num_layers != shape.num_layers or kv.num_tokens != len(segment):
                raise FusionInputError(
                    f"segment {i}: KV covers {kv.num_tokens} tokens x {kv.num_layers} layers, "
                    f"expected {len(segment)} tokens x {shape.num_layers} layers"
                )
        total = sum(len(s) for s in segments)
        if total > shape.max_context:
            raise ContextLengthError(
                f"prompt of {total} tokens exceeds the model's context of {shape.max_context}"
            )

    def route(self, request: FusionRequest) -> FusionRoute:
        """How ``request`` is fused, decided once: the static steps where this fusor runs them and they
        cover the request (no attention observer, no scores or probe suffix from a round, a method with a
        static selection), else the layer passes. Bad input raises here."""
        self.validate(request.segments)
        plan = FusionPlan.from_segments(request.segments, logits=request.logits)
        # the static steps always end in the last token's logits
        if self.weights is None or request.observer is not None or not request.logits:
            return FusionRoute(request, plan, FusionPath.LAYERS)
        if request.query_scores is not None or request.probe_suffix:
            return FusionRoute(request, plan, FusionPath.LAYERS)
        selection = request.method.static_selection(plan, self.model.num_layers)
        if selection is None:
            return FusionRoute(request, plan, FusionPath.LAYERS)
        path = FusionPath.GRAPHS if self.graphs is not None else FusionPath.STATIC
        return FusionRoute(request, plan, path, selection)

    def fuse(
        self,
        segments: list[Segment],
        method: RecomputeMethod,
        kv_provider: LayerKVProvider | None = None,
        extra_capacity: int = 0,
        observer: AttentionObserver | None = None,
    ) -> FusionResult:
        """Fuse ``segments`` with ``method``; ``kv_provider`` serves cached layers (default: direct reads).
        The returned cache has room for ``extra_capacity`` more tokens (the decode budget)."""
        return self.fuse_many([FusionRequest(segments, method, kv_provider, extra_capacity, observer)])[0]

    def fuse_many(
        self, requests: Sequence[FusionRequest], also: Sequence[LayerPass] = ()
    ) -> list[FusionResult]:
        """:meth:`fuse_routes` of ``requests`` routed (:meth:`route`)."""
        return self.fuse_routes([self.route(request) for request in requests], also)

    @torch.inference_mode()
    def fuse_routes(
        self, routes: Sequence[FusionRoute], also: Sequence[LayerPass] = ()
    ) -> list[FusionResult]:
        """Fuse each route on its path, results in order: each static one by the static steps; the others
        together, at every layer one q/k/v projection and one MLP over the tokens all of them compute,
        attention per prompt. Each result equals fusing its prompt alone. ``also``: passes of the caller's
        (a round's members, blend/round_members.py) run in the same layers. Every route's loader is
        closed once it ran (or failed)."""
        results: dict[int, FusionResult] = {}
        layered = [i for i, route in enumerate(routes) if not route.static]
        try:
            for i, route in enumerate(routes):
                if route.static:
                    results[i] = self._fuse_static(route)
            if layered or also:
                runs = [_Run(self, routes[i]) for i in layered]
                results.update(zip(layered, self._fuse_layers(runs, also), strict=True))
        finally:
            for route in routes:
                if route.request.kv_provider is not None:
                    route.request.kv_provider.close()
        return [results[i] for i in range(len(routes))]

    def _fuse_layers(self, runs: list[_Run], also: Sequence[LayerPass]) -> list[FusionResult]:
        model = self.model
        try:
            probes = {id(run): run.probe_pass() for run in runs if run.wants_probe}
            if probes:
                with record_function("fusion::probe"):
                    _run_probes(model, list(probes.values()))
            for run in runs:
                run.begin(probes.get(id(run)))
            with record_function("fusion::layers"):
                for layer in range(model.num_layers):
                    run_layer(model, layer, [*runs, *also])
        finally:
            for run in runs:
                run.provider.close()
        return [run.result() for run in runs]

    def _fuse_static(self, route: FusionRoute) -> FusionResult:
        """``route`` by the static steps (its plan and selection as routed)."""
        started = time.perf_counter()
        request, plan = route.request, route.plan
        provider = request.kv_provider or DirectLayerKV(kv_sources(request.segments))
        fusion = static_fusion(
            self.model,
            plan,
            request.method,
            provider,
            request.extra_capacity,
            self.layer_hook,
            self.steps,
            route.selection,
        )
        assert fusion is not None  # routed here only with packed weights and a static selection
        try:
            logits, selected, cache = fusion.run() if self.graphs is None else self.graphs.run(fusion)
        finally:
            provider.close()
        if fusion.scores is not None:
            attention, contribution = (score[: plan.num_tokens].cpu() for score in fusion.scores)
            plan.query_attention, plan.query_contribution = attention, contribution
        return FusionResult(
            buffer=cache,
            logits=logits,
            plan=plan,
            selected=selected,
            qkv_tokens_per_layer=fusion.qkv_counts,
            attended_tokens_per_layer=fusion.attended_counts,
            seconds=time.perf_counter() - started,
            load_wait_s=fusion.load_wait,
            probe_token_layers=fusion.probe_token_layers,
            path=route.path,
        )

    @torch.inference_mode()
    def probe(self, segments: list[Segment], kv_provider: LayerKVProvider | None = None) -> ProbeResult:
        """Only the query probe of ``segments`` (:mod:`.probe`): where their question looks."""
        run = _Run(self, self.route(FusionRequest(segments, _PROBE_ONLY, kv_provider)))
        probe = run.probe_pass()
        try:
            _run_probes(self.model, [probe])
        finally:
            run.provider.close()
        return probe.result()

    @staticmethod
    def _check_selection(plan: FusionPlan, chosen: torch.Tensor, previous: torch.Tensor | None) -> None:
        """A method may only narrow the set, and may never drop fresh text or the last token."""
        chosen_cpu = chosen.cpu()
        if chosen_cpu.numel() and not bool((chosen_cpu[1:] > chosen_cpu[:-1]).all()):
            raise FusionInputError("a method returned positions that are not strictly ascending")
        if not bool(plan.must_compute[chosen_cpu].sum() == plan.must_compute.sum()):
            raise FusionInputError("a method dropped fresh-text positions, which must always be computed")
        if previous is not None and not bool(torch.isin(chosen_cpu, previous.cpu()).all()):
            raise FusionInputError("a method selected positions not computed at the previous layer")


def _run_probes(model: LayerwiseModel, probes: list[ProbePass]) -> None:
    """Each probe's layers (the first ``probe.layers``), those that share a layer in one batch; a probe's
    last layer stops before attention (only its K/V and what it records from q/k/v are needed) unless it
    was asked for the next token's logits."""
    for layer in range(max(probe.layers for probe in probes)):
        active = [probe for probe in probes if layer < probe.layers]
        run_layer(model, layer, active, finish=any(probe.finishes(layer) for probe in active))


class _Run:
    """One prompt's fusion as a :class:`~.layers.LayerPass`: its plan, cache and selected positions."""

    def __init__(self, fusor: Fusor, route: FusionRoute) -> None:
        self.started = time.perf_counter()
        self.fusor, self.model = fusor, fusor.model
        request = route.request
        self.method, self.observer, self.logits = request.method, request.observer, request.logits
        segments = request.segments
        self.plan = plan = route.plan
        self.provider = request.kv_provider or DirectLayerKV(kv_sources(segments))
        self.spans = plan.cached_spans()
        # every slot 0..n-1 is written before attention reads it (placed or recomputed), decode slots too
        self.probe_suffix = request.probe_suffix
        room = max(request.extra_capacity, len(self.probe_suffix))
        self.cache = self.model.new_cache(plan.num_tokens + room, zeroed=False)
        self.placement = CachedPlacement.for_spans(self.model.rope, self.spans, self.model.device)
        self.check_layers = set(request.method.check_layers(plan))
        self.shift = None
        if request.method.shifts_chunks():
            self.shift = ChunkShift(plan, self.model.rope, self.model.device)
        self.num_cached_total = int(plan.cached_mask.sum())
        self.query_scores = request.query_scores
        self.wants_probe = (
            plan.num_cached > 0 and self.query_scores is None and request.method.uses_query_attention(plan)
        )
        self.placed_layers = 0  # the first layers, whose cached KV a probe placed already
        self.qkv_counts: list[int] = []
        self.attended_counts: list[int] = []
        self.load_wait = 0.0
        self.probe_token_layers = 0

    def probe_pass(self) -> ProbePass:
        plan = self.plan
        if self.probe_suffix:  # the same layout with the suffix's rows after it
            plan = FusionPlan.from_segments([*plan.segments, Segment.fresh(self.probe_suffix)])
        layers = self.method.probe_layers(self.model.num_layers)
        # a suffix's last row is another question's: the prompt's own next token is not there
        logits = self.method.probe_logits() and not self.probe_suffix
        return ProbePass(self.model, plan, self.cache, self.provider, self.placement.place, layers, logits)

    def begin(self, probe: ProbePass | None) -> None:
        """Take the probe's findings (when one ran) and the method's layer-0 positions."""
        plan, model = self.plan, self.model
        if probe is not None:
            result = probe.result()
            n = plan.num_tokens  # (a probe suffix's positions come after the prompt's)
            plan.query_attention, plan.query_contribution = result.attention[:n], result.contribution[:n]
            plan.probe_logits = result.logits
            self.load_wait, self.probe_token_layers, self.placed_layers = (
                result.load_wait_s,
                result.token_layers,
                probe.layers,
            )
        elif self.query_scores is not None:
            plan.query_attention, plan.query_contribution = self.query_scores
        selected = self.method.layer0_positions(plan).to(model.device)
        self.fusor._check_selection(plan, selected, None)
        if not selected.numel():  # (only without logits and fresh text): a layer needs a row to run
            selected = torch.tensor([plan.num_tokens - 1], device=model.device)
        self.hidden = model.embed(plan.token_ids[selected.cpu()][None]).to(model.dtype)
        self._select(selected)

    def _select(self, selected: torch.Tensor) -> None:
        self.positions = selected
        # whether some cached position keeps its cached K/V: read once per selection, not at every layer
        # (on an accelerator each read waits for the queued work)
        self.keeps_cached = int(self.plan.cached_mask[selected.cpu()].sum()) < self.num_cached_total
        self.cos_sin = self.model.rope.cos_sin(selected, self.model.dtype)
        self.mask = AttentionMask.for_positions(selected, self.plan.num_tokens)

    def attention_inputs(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        plan, cache, selected = self.plan, self.cache, self.positions
        n = plan.num_tokens
        self.qkv_counts.append(selected.numel())
        if self.spans and layer >= self.placed_layers:  # (a probe placed the layers it ran)
            waited = time.perf_counter()
            layer_kv = self.provider.layer(layer)  # providers serve layers in order; always ask
            self.load_wait += time.perf_counter() - waited
            # placing is skipped where every cached position is recomputed anyway
            if self.keeps_cached or layer in self.check_layers:
                self.placement.place(cache, layer, layer_kv)
        narrowed = None
        if layer in self.check_layers:
            state = LayerState(  # (indexing copies the cached K/V before the write below)
                layer,
                plan,
                selected.cpu(),
                k[0],
                v[0],
                cache.keys[layer][0][:, selected],
                cache.values[layer][0][:, selected],
            )
            narrowed = self.method.select(state).to(self.model.device)
            self.fusor._check_selection(plan, narrowed, selected)
            if not narrowed.numel():  # (as at layer 0)
                narrowed = selected[-1:]
        # what the recomputed rows changed, onto the rest of their chunks (when any of them is kept)
        if self.shift is not None and self.keeps_cached:
            self.shift.apply(cache.keys[layer][0], cache.values[layer][0], selected, k[0], v[0])
        cache.write(layer, selected, k, v)  # every candidate's fresh K/V is better than its cached one
        if narrowed is not None:
            keep = torch.searchsorted(selected, narrowed)
            self.hidden, q = self.hidden[:, keep], q[:, :, keep]
            self._select(narrowed)
        keys, values = cache.keys[layer][:, :, :n], cache.values[layer][:, :, :n]
        if self.observer is not None:
            self.observer(layer, self.positions, q, keys, self.mask)
        elif layer == self.model.num_layers - 1 and self.positions.numel() > 1:
            # the last layer's K/V are written: only the last token's output (the answer's first token's
            # logits) is still needed, the rest of the selection attends and runs its MLP for nothing
            self.hidden, q = self.hidden[:, -1:], q[:, :, -1:]
            self.attended_counts.append(1)
            return q, keys, values, AttentionMask.for_positions(self.positions[-1:], n)
        self.attended_counts.append(self.positions.numel())
        return q, keys, values, self.mask

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        return self.model.attend(q, keys, values, mask)

    def result(self) -> FusionResult:
        # the last prompt token is always selected where logits are wanted
        logits = self.model.logits(self.hidden[:, -1])[0] if self.logits else torch.empty(0)
        self.cache.length = self.plan.num_tokens
        return FusionResult(
            buffer=self.cache,
            logits=logits,
            plan=self.plan,
            selected=self.positions.cpu(),
            qkv_tokens_per_layer=self.qkv_counts,
            attended_tokens_per_layer=self.attended_counts,
            seconds=time.perf_counter() - self.started,
            load_wait_s=self.load_wait,
            probe_token_layers=self.probe_token_layers,
        )
