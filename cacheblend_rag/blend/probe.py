"""The query probe: where does the question look in the cached chunks?

A method that selects tokens by the attention the question pays them (query-aware selection) needs that
attention before it chooses. The probe is a cheap first pass over the prompt: every cached chunk keeps
its cached K/V at every layer (as ``full_reuse`` does) and only the fresh text is computed — a few
percent of a full prefill. At each layer it records the attention probabilities of the query rows (the
fresh text after the last cached chunk: the question and the generation prompt, whose last token
produces the answer) over every position, summed over heads and query rows and then over layers.

The probe leaves every cached chunk's K/V placed in the cache (re-rotated to its prompt positions), so
the pass that follows only overwrites the positions it recomputes; nothing is loaded or rotated twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..models.runtime import AttentionMask, KVCache, LayerwiseModel
from .plan import FusionPlan
from .segments import LayerKVProvider


@dataclass
class ProbeResult:
    """Attention mass the query rows paid each prompt position ([T], summed over heads, query rows and
    layers), the same weighted by each position's value norm (its contribution), and what the probe
    cost."""

    attention: torch.Tensor
    contribution: torch.Tensor  # attention weighted by the norm of each position's value, [T]
    query_positions: torch.Tensor
    token_layers: int
    seconds: float
    load_wait_s: float


def query_positions(plan: FusionPlan) -> torch.Tensor:
    """The probe's query rows: the fresh text after the last cached chunk (always including the last
    prompt token, whose hidden state gives the answer's first token)."""
    spans = plan.chunk_spans()
    start = spans[-1][1] if spans else 0
    rows = plan.must_compute.nonzero().squeeze(1)
    return rows[rows >= min(start, plan.num_tokens - 1)]


@torch.inference_mode()
def run_probe(
    model: LayerwiseModel,
    plan: FusionPlan,
    cache: KVCache,
    provider: LayerKVProvider,
    place_cached: Callable[[KVCache, int, list[tuple[torch.Tensor, torch.Tensor]]], None],
) -> ProbeResult:
    """Compute the fresh text over the cached KV at every layer and record where the query rows look.

    ``place_cached(cache, layer, layer_kv)`` writes a layer's cached chunk K/V into ``cache``; every layer
    of it stays there for the pass that follows."""
    started = time.perf_counter()
    device, dtype = model.device, model.dtype
    n = plan.num_tokens
    fresh = plan.must_compute.nonzero().squeeze(1).to(device)
    queries = query_positions(plan).to(device)
    rows = torch.searchsorted(fresh, queries)
    positions = torch.arange(n, device=device)
    hidden = model.embed(plan.token_ids[fresh.cpu()][None].to(device)).to(dtype)
    cos_sin = model.rope.cos_sin(positions[fresh], dtype)
    mask = AttentionMask.for_positions(fresh, n)
    # query row i sees the keys at positions <= queries[i]
    visible = positions[None, :] <= queries[:, None]  # [m, T]
    attention = torch.zeros(n, dtype=torch.float32, device=device)
    contribution = torch.zeros(n, dtype=torch.float32, device=device)
    load_wait = 0.0
    for layer in range(model.num_layers):
        qkv = model.project_qkv(layer, hidden, positions[fresh], cos_sin)
        waited = time.perf_counter()
        layer_kv = provider.layer(layer)
        load_wait += time.perf_counter() - waited
        place_cached(cache, layer, layer_kv)
        cache.write(layer, fresh, qkv.k, qkv.v)
        keys, values = cache.keys[layer][:, :, :n], cache.values[layer][:, :, :n]
        mass = _attention_mass(qkv.q[0, :, rows], keys[0], visible, model.scaling)  # [Hkv, T]
        attention += mass.sum(dim=0)
        # what a token adds to the attention output scales with its value's norm too
        contribution += (mass * values[0].float().norm(dim=-1)).sum(dim=0)
        if layer < model.num_layers - 1:  # the last layer's output is not needed
            hidden = model.attend_and_mlp(layer, hidden, qkv.q, keys, values, mask)
    return ProbeResult(
        attention=attention.cpu(),
        contribution=contribution.cpu(),
        query_positions=queries.cpu(),
        token_layers=fresh.numel() * model.num_layers,
        seconds=time.perf_counter() - started,
        load_wait_s=load_wait,
    )


def _attention_mass(
    q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Softmax attention of ``q`` [H, m, d] over ``keys`` [Hkv, T, d] (grouped-query heads share a KV
    head), summed over the query rows and the heads of each KV head: [Hkv, T]."""
    heads, m, d = q.shape
    kv_heads = keys.shape[0]
    grouped = q.float().reshape(kv_heads, (heads // kv_heads) * m, d)  # heads of one group are adjacent
    scores = grouped @ keys.float().transpose(1, 2) * scaling  # [Hkv, g*m, T]
    scores = scores.view(kv_heads, heads // kv_heads, m, -1).masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1).sum(dim=(1, 2))
