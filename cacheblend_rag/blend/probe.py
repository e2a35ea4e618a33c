"""The query probe: where does the question look in the cached chunks?

A method that selects tokens by the attention the question pays them (query-aware selection) needs that
attention before it chooses. The probe is a cheap first pass over the prompt: every cached chunk keeps
its cached K/V at every layer (as ``full_reuse`` does) and only the fresh text is computed — a few
percent of a full prefill. At each layer it records the attention probabilities of the query rows (the
fresh text after the last cached chunk: the question and the generation prompt, whose last token
produces the answer) over every position, summed over heads and query rows and then over layers, and
the same weighted by each position's value norm (what the position adds to the attention output). The
probabilities come from one float32 batched matmul and softmax per layer over every fresh row, and the
fresh text's attention output is those probabilities times the values (no second attention kernel).

The probe leaves every cached chunk's K/V placed in the cache (re-rotated to its prompt positions) at
the layers it ran, so the pass that follows only overwrites the positions it recomputes there; nothing is
loaded or rotated twice. A probe may run only the first ``layers`` layers (a method's
``probe_layers``): cheaper, and scored by those layers only; the pass that follows places the rest.
A probe asked for ``logits`` finishes its last layer too and gives the next token's logits at its last
row: the first-token distribution full reuse would answer with (a per-request budget reads how sure it is).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..models.attention import AttentionMask
from ..models.runtime import KVCache, LayerwiseModel, ModelShape
from .plan import FusionPlan
from .segments import LayerKVProvider

PlaceCached = Callable[[KVCache, int, list[tuple[torch.Tensor, torch.Tensor]]], None]


@dataclass
class ProbeResult:
    """Attention mass the query rows paid each prompt position ([T], summed over heads, query rows and
    layers), the same weighted by each position's value norm (its contribution), and what the probe
    cost (``token_layers``: the fresh rows' attention+MLP token-layers; the probe's last layer only
    scores, with no attention output or MLP)."""

    attention: torch.Tensor
    contribution: torch.Tensor
    query_positions: torch.Tensor
    token_layers: int
    seconds: float
    load_wait_s: float
    logits: torch.Tensor | None = None  # [V] at the last row, when the probe was asked for them


def query_positions(plan: FusionPlan) -> torch.Tensor:
    """The probe's query rows: the fresh text after the last cached chunk (always including the last
    prompt token, whose hidden state gives the answer's first token)."""
    spans = plan.chunk_spans()
    start = spans[-1][1] if spans else 0
    rows = plan.must_compute.nonzero().squeeze(1)
    return rows[rows >= min(start, plan.num_tokens - 1)]


class ProbePass:
    """One request's probe as a :class:`~.layers.LayerPass`: the fresh text at every layer, the cached
    chunks placed by ``place_cached(cache, layer, layer_kv)`` as their layers arrive."""

    def __init__(
        self,
        model: LayerwiseModel,
        plan: FusionPlan,
        cache: KVCache,
        provider: LayerKVProvider,
        place_cached: PlaceCached,
        layers: int | None = None,
        logits: bool = False,
    ) -> None:
        self.started = time.perf_counter()
        device = model.device
        self.model, self.plan, self.cache, self.provider, self.place_cached = (
            model,
            plan,
            cache,
            provider,
            place_cached,
        )
        n = plan.num_tokens
        self.layers = model.num_layers if layers is None else layers  # the first ones, 1..num_layers
        # the next token's logits need every layer finished; a shallower probe only scores
        self.wants_logits = logits and self.layers == model.num_layers
        self.positions = plan.must_compute.nonzero().squeeze(1).to(device)
        self.queries = query_positions(plan).to(device)
        self.hidden = model.embed(plan.token_ids[self.positions.cpu()][None].to(device)).to(model.dtype)
        self.cos_sin = model.rope.cos_sin(self.positions, model.dtype)
        self.mask = AttentionMask.for_positions(self.positions, n)
        # the query rows are the fresh rows' suffix (query_positions), so one slice of the probabilities
        self.query_start = int(torch.searchsorted(self.positions, self.queries[:1]))
        self.grouped_mask = grouped_causal_mask(self.positions, n, model.shape)
        self.probabilities: torch.Tensor | None = None
        # the scores and probabilities of every layer have one shape: kept across layers, not allocated at
        # each (a round's probe of many questions makes them tens of MB, each fresh one page-faulted)
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self.attention = torch.zeros(n, dtype=torch.float32, device=device)
        self.contribution = torch.zeros(n, dtype=torch.float32, device=device)
        self.load_wait = 0.0

    def attention_inputs(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        waited = time.perf_counter()
        layer_kv = self.provider.layer(layer)
        self.load_wait += time.perf_counter() - waited
        self.place_cached(self.cache, layer, layer_kv)
        self.cache.write(layer, self.positions, k, v)
        n = self.plan.num_tokens
        keys, values = self.cache.keys[layer][:, :, :n], self.cache.values[layer][:, :, :n]
        # every fresh row's probabilities: the query rows' give the mass, and attend() reuses them all
        # for the fresh text's attention output (no second attention kernel over the same scores)
        if self.buffers is None:
            shape = (keys.shape[1], q.shape[1] // keys.shape[1] * q.shape[2], n)
            self.buffers = (torch.empty(shape, device=q.device), torch.empty(shape, device=q.device))
        mask, scaling = self.grouped_mask, self.model.scaling
        probabilities = query_probabilities(q[0], keys[0], mask, scaling, self.buffers)
        # [Hkv, T]; rows, then heads (one reduction over both strided dims is ~8x slower on CPU)
        mass = probabilities[:, :, self.query_start :].sum(dim=2).sum(dim=1)
        self.attention += mass.sum(dim=0)
        # what a token adds to the attention output scales with its value's norm too
        self.contribution += (mass * values[0].float().norm(dim=-1)).sum(dim=0)
        self.probabilities = probabilities
        return q, keys, values, self.mask

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        """The fresh rows' attention output [1, m, H * d] from this layer's probabilities."""
        probabilities, self.probabilities = self.probabilities, None
        self.model.attention_token_layers += q.shape[2]
        return attention_output(probabilities, values[0]).to(q.dtype)

    def finishes(self, layer: int) -> bool:
        """Whether ``layer`` runs attention and MLP too (every layer but a scoring-only last one)."""
        return layer < self.layers - 1 or self.wants_logits

    def result(self) -> ProbeResult:
        logits = None
        if self.wants_logits:
            logits = self.model.logits(self.hidden[:, -1])[0].float().cpu()
        finished = self.layers if self.wants_logits else self.layers - 1
        return ProbeResult(
            attention=self.attention.cpu(),
            contribution=self.contribution.cpu(),
            query_positions=self.queries.cpu(),
            # attention and MLP ran at every probe layer it finished
            token_layers=self.positions.numel() * finished,
            seconds=time.perf_counter() - self.started,
            load_wait_s=self.load_wait,
            logits=logits,
        )


def grouped_causal_mask(positions: torch.Tensor, n: int, shape: ModelShape) -> torch.Tensor:
    """Additive float32 causal mask of rows at ``positions`` over keys 0..n-1, stacked once per head of a
    KV group (the row order of :func:`query_probabilities`): [1, g*m, n], built once for every layer."""
    visible = torch.arange(n, device=positions.device)[None, :] <= positions[:, None]  # [m, n]
    additive = torch.zeros(visible.shape, dtype=torch.float32, device=positions.device)
    additive.masked_fill_(~visible, float("-inf"))
    return additive.repeat(shape.num_heads // shape.num_kv_heads, 1)[None]


def query_probabilities(
    q: torch.Tensor,
    keys: torch.Tensor,
    grouped_mask: torch.Tensor,
    scaling: float,
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Softmax attention (float32) of ``q`` [H, m, d] over ``keys`` [Hkv, T, d] under ``grouped_mask``
    (:func:`grouped_causal_mask`): [Hkv, g, m, T], g heads per KV head (grouped-query heads of one KV
    head are adjacent). One batched matmul per layer, the scale and mask folded into it; scores and
    probabilities written into ``buffers`` (two float32 [Hkv, g * m, T]; new ones when None), the latter
    returned."""
    heads, m, d = q.shape
    kv_heads = keys.shape[0]
    grouped = q.float().reshape(kv_heads, (heads // kv_heads) * m, d)
    shape = (kv_heads, (heads // kv_heads) * m, keys.shape[1])
    scores, probabilities = buffers or (
        torch.empty(shape, device=q.device),
        torch.empty(shape, device=q.device),
    )
    torch.baddbmm(grouped_mask, grouped, keys.float().transpose(1, 2), alpha=scaling, out=scores)
    torch.ops.aten._softmax.out(scores, -1, False, out=probabilities)  # what torch.softmax runs
    return probabilities.view(kv_heads, heads // kv_heads, m, -1)


def attention_output(probabilities: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Attention output of :func:`query_probabilities` ([Hkv, g, m, T]) over ``values`` [Hkv, T, d], heads
    concatenated as the o-proj takes them: [1, m, H * d] in float32."""
    kv_heads, groups, m, n = probabilities.shape
    out = torch.bmm(probabilities.view(kv_heads, groups * m, n), values.float())  # [Hkv, g*m, d]
    return out.view(1, kv_heads * groups, m, -1).transpose(1, 2).reshape(1, m, -1)
