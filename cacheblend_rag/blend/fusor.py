"""The fusor: turn independently precomputed chunk KV plus fresh text into one KV cache for the prompt.

The algorithm, per the CacheBlend paper:

1. lay the segments out; each cached chunk's keys are re-rotated (float32) from its own positions 0..n-1
   to where it lands in the prompt;
2. layer 0 runs for the positions the method picks (every token, for CacheBlend);
3. at each later layer, the positions computed at the previous layer are projected to fresh Q/K/V; at a
   check layer the method compares fresh and cached K/V and keeps the tokens with the highest deviation
   (HKVD), narrowing gradually to the final ratio; only those tokens attend and run the MLP, with an exact
   causal mask over the layer's full-length K/V;
4. every other position keeps its cached K/V, so the resulting cache is the cached KV with the
   recomputed tokens' K/V written over it; generation continues from it like from a full prefill.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import ContextLengthError, FusionInputError
from ..models.rope import Rope
from ..models.runtime import AttentionMask, KVCache, LayerwiseModel
from .methods import RecomputeMethod
from .plan import FusionPlan, LayerState
from .probe import run_probe
from .segments import DirectLayerKV, LayerKVProvider, Segment

# Called at every layer with (layer, query positions, q [1, H, S, d], keys [1, Hkv, T, d], mask): lets
# diagnostics look at attention without a second code path.
AttentionObserver = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMask], None]


@dataclass
class FusionResult:
    """The fused cache (positions 0..T-1 filled), next-token logits and what it cost."""

    cache: KVCache
    logits: torch.Tensor  # [vocab] float32, for the token after the prompt
    plan: FusionPlan
    selected: torch.Tensor  # positions recomputed at the last layer
    qkv_tokens_per_layer: list[int] = field(default_factory=list)
    attended_tokens_per_layer: list[int] = field(default_factory=list)
    seconds: float = 0.0
    load_wait_s: float = 0.0
    probe_token_layers: int = 0  # fresh-text token-layers of the query probe (0 when none ran)

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    @property
    def reused_tokens(self) -> int:
        """Cached-chunk tokens whose KV was kept at the last layer."""
        recomputed = torch.zeros(self.plan.num_tokens, dtype=torch.bool)
        recomputed[self.selected] = True
        return int((self.plan.cached_mask & ~recomputed).sum())

    @property
    def computed_tokens(self) -> int:
        return self.plan.num_tokens - self.reused_tokens

    @property
    def recompute_ratio(self) -> float:
        """Share of the cached tokens that are worth recomputing (not exact) recomputed at the last layer."""
        blended = self.plan.cached_mask & ~self.plan.exact_mask
        total = int(blended.sum())
        if total == 0:
            return 1.0
        return float(blended[self.selected].sum()) / total

    @property
    def compute_fraction(self) -> float:
        """Attention+MLP token-layers done (the query probe's included), relative to a full prefill of
        the same prompt."""
        return (sum(self.attended_tokens_per_layer) + self.probe_token_layers) / (
            self.plan.num_tokens * len(self.attended_tokens_per_layer)
        )


class Fusor:
    """Applies a :class:`RecomputeMethod` layer by layer on a :class:`LayerwiseModel`."""

    def __init__(self, model: LayerwiseModel) -> None:
        self.model = model

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

    @torch.inference_mode()
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
        started = time.perf_counter()
        self.validate(segments)
        plan = FusionPlan.from_segments(segments)
        model = self.model
        device, dtype = model.device, model.dtype
        provider = kv_provider or DirectLayerKV([s.kv for s in segments if s.kv is not None])
        cached_spans = plan.cached_spans()
        n = plan.num_tokens
        # every slot 0..n-1 is written before attention reads it (placed or recomputed), decode slots too
        cache = model.new_cache(n + extra_capacity, zeroed=False)
        rotations = self._rerotations(cached_spans)
        positions = torch.arange(n, device=device)
        check_layers = set(method.check_layers(plan))
        num_cached_total = int(plan.cached_mask.sum())

        qkv_counts, attended_counts, load_wait, probe = [], [], 0.0, None
        try:
            if plan.num_cached and method.uses_query_attention(plan):
                place = functools.partial(self._place_cached, spans=cached_spans, rotations=rotations)
                probe = run_probe(model, plan, cache, provider, place)
                plan.query_attention, plan.query_contribution = probe.attention, probe.contribution
                load_wait = probe.load_wait_s
            selected = method.layer0_positions(plan).to(device)
            self._check_selection(plan, selected, None)
            hidden = model.embed(plan.token_ids[selected.cpu()][None]).to(dtype)
            cos_sin = model.rope.cos_sin(positions[selected], dtype)
            mask = AttentionMask.for_positions(selected, n)
            for layer in range(model.num_layers):
                qkv = model.project_qkv(layer, hidden, positions[selected], cos_sin)
                qkv_counts.append(selected.numel())
                if cached_spans and probe is None:  # the probe placed every cached layer already
                    waited = time.perf_counter()
                    layer_kv = provider.layer(layer)  # providers serve layers in order; always ask
                    load_wait += time.perf_counter() - waited
                    # Placing is skipped where every cached position is recomputed anyway.
                    needs_cached = int(plan.cached_mask[selected.cpu()].sum()) < num_cached_total
                    if needs_cached or layer in check_layers:
                        self._place_cached(cache, layer, layer_kv, cached_spans, rotations)
                if layer in check_layers:
                    state = LayerState(
                        layer,
                        plan,
                        selected.cpu(),
                        qkv.k[0],
                        qkv.v[0],
                        cache.keys[layer][0][:, selected],
                        cache.values[layer][0][:, selected],
                    )
                    narrowed = method.select(state).to(device)
                    self._check_selection(plan, narrowed, selected)
                    # Every candidate's fresh K/V is better than its cached one and already paid for.
                    cache.write(layer, selected, qkv.k, qkv.v)
                    keep = torch.searchsorted(selected, narrowed)
                    hidden, qkv.q, selected = hidden[:, keep], qkv.q[:, :, keep], narrowed
                    cos_sin = model.rope.cos_sin(positions[selected], dtype)
                    mask = AttentionMask.for_positions(selected, n)
                else:
                    cache.write(layer, selected, qkv.k, qkv.v)
                keys, values = cache.keys[layer][:, :, :n], cache.values[layer][:, :, :n]
                if observer is not None:
                    observer(layer, selected, qkv.q, keys, mask)
                hidden = model.attend_and_mlp(layer, hidden, qkv.q, keys, values, mask)
                attended_counts.append(selected.numel())
        finally:
            provider.close()
        cache.length = n
        logits = model.logits(hidden[:, -1])[0]  # the last prompt token is always selected
        return FusionResult(
            cache=cache,
            logits=logits,
            plan=plan,
            selected=selected.cpu(),
            qkv_tokens_per_layer=qkv_counts,
            attended_tokens_per_layer=attended_counts,
            seconds=time.perf_counter() - started,
            load_wait_s=load_wait,
            probe_token_layers=probe.token_layers if probe is not None else 0,
        )

    def _rerotations(self, spans: list[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per cached span, the float64 tables that turn its keys from 0..n-1 to its prompt positions;
        the same at every layer, so computed once per fusion."""
        device = self.model.device
        tables = []
        for start, end in spans:
            local = torch.arange(end - start, device=device)
            tables.append(self.model.rope.rerotation(local, local + start))
        return tables

    def _place_cached(
        self,
        cache: KVCache,
        layer: int,
        layer_kv: list[tuple[torch.Tensor, torch.Tensor]],
        spans: list[tuple[int, int]],
        rotations: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Write each cached chunk's K/V at its prompt positions, keys re-rotated from 0..n-1."""
        device, dtype = self.model.device, self.model.dtype
        for (k, v), (start, end), tables in zip(layer_kv, spans, rotations, strict=True):
            keys = Rope.apply_rerotation(k.to(device, torch.float32), tables)
            cache.keys[layer][0, :, start:end] = keys.to(dtype)
            cache.values[layer][0, :, start:end] = v.to(device, dtype)

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
