"""Rounds: requests that read the same cached chunks share one blend of them.

When N requests (agents, users) read the same retrieved chunks at once, per-request fusion loads,
places, probes and recomputes the same chunks N times. A round does that once:

1. requests fused with equal methods whose cached chunks are the same (in any order, at any offset)
   form a round of two or more; the method's :meth:`~.methods.RecomputeMethod.round_sharing` may narrow
   it to requests whose text up to their last chunk is the same (cacheblend at r = 1, so every request
   still gets exactly its own full prefill) or rule rounds out;
2. the round's prompt is its first request's text up to and including its last chunk. A method that
   selects by the question's attention gets one probe of that prompt followed by every request's
   question, so the selection is scored for the round (the sum of its questions' attention) and the
   budget is r of the round's cached tokens, not r per request;
3. the round's prompt is fused once; each chunk's blended K/V is taken out of it, its keys rotated back
   to the chunk's own positions 0..n-1;
4. every request is then fused with its chunks' KV replaced by the round's blend, marked exact so
   nothing in it is recomputed again: its own text (before, between or after the chunks) is computed over
   them with exact attention, each chunk re-rotated to wherever it sits in that request's prompt. A
   request without a round is fused as it would be alone; all of them together in one batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from ..models.rope import Rope
from .fusor import FusionRequest, FusionResult, Fusor, RoundShare
from .methods import RoundSharing
from .plan import FusionPlan
from .probe import query_positions
from .segments import ChunkKV, ChunkKVSource, DirectLayerKV, LayerKVProvider, Segment

# Where a pass of the round reads its cached layers from (the engine passes its pipelined loader).
ProviderFactory = Callable[[Sequence[ChunkKVSource]], LayerKVProvider]


def _is_chunk(segment: Segment) -> bool:
    return segment.is_cached and not segment.exact


def _last_chunk(segments: Sequence[Segment]) -> int:
    return max(i for i, s in enumerate(segments) if _is_chunk(s))


def plan_rounds(requests: Sequence[FusionRequest]) -> list[list[int]]:
    """Indices of the requests that form each round (two or more each, first request first)."""
    groups: dict[tuple, list[int]] = {}
    for i, request in enumerate(requests):
        sharing = request.method.round_sharing()
        chunks = tuple(sorted(s.token_ids for s in request.segments if _is_chunk(s)))
        if sharing is RoundSharing.NONE or not chunks:
            continue
        key: tuple = (request.method, chunks)
        if sharing is RoundSharing.SAME_PREFIX:
            segments = request.segments[: _last_chunk(request.segments) + 1]
            key += (tuple(t for s in segments for t in s.token_ids),)
        groups.setdefault(key, []).append(i)
    return [members for members in groups.values() if len(members) > 1]


def fuse_round(
    fusor: Fusor, requests: Sequence[FusionRequest], provider_for: ProviderFactory = DirectLayerKV
) -> list[FusionResult]:
    """Fuse ``requests`` together, each round of them (:func:`plan_rounds`) sharing one blend of its
    chunks; results in order, each carrying its :class:`RoundShare` when it had one."""
    rounds = plan_rounds(requests)
    jobs = list(requests)
    shares: dict[int, RoundShare] = {}
    for members in rounds:
        blended, share = _blend_round(fusor, [requests[i] for i in members], provider_for)
        for i in members:
            jobs[i], shares[i] = _member(requests[i], blended, share, provider_for)
    results = fusor.fuse_many(jobs)
    for i, share in shares.items():
        results[i].round = share
    return results


def _blend_round(
    fusor: Fusor, members: list[FusionRequest], provider_for: ProviderFactory
) -> tuple[dict[tuple[tuple[int, ...], int], ChunkKV], RoundShare]:
    """The round's one probe and blend: each chunk's blended KV (keys at 0..n-1) and what it cost."""
    started = time.perf_counter()
    lead = members[0]
    segments = list(lead.segments[: _last_chunk(lead.segments) + 1])
    sources = [s.kv for s in segments if s.kv is not None]
    plan = FusionPlan.from_segments(segments)
    scores = None
    if plan.num_cached and lead.method.uses_query_attention(plan):
        questions = [t for m in members for t in _question(m.segments)]
        probe = fusor.probe([*segments, Segment.fresh(questions)], provider_for(sources))
        n = plan.num_tokens
        scores = (probe.attention[:n], probe.contribution[:n])
    # the lead's own loader serves exactly these cached segments, in order
    provider = lead.kv_provider if lead.kv_provider is not None else provider_for(sources)
    blend = fusor.fuse_many([FusionRequest(segments, lead.method, provider, query_scores=scores)])[0]
    for member in members[1:]:  # their chunks come from the round: nothing of theirs is read
        if member.kv_provider is not None:
            member.kv_provider.close()
    blended = _blended_chunks(fusor, blend)
    recomputable = blend.plan.cached_mask & ~blend.plan.exact_mask
    share = RoundShare(
        requests=len(members),
        shared_tokens=0,  # per member, set in _member
        round_recomputed_tokens=int(recomputable[blend.selected].sum()),
        recompute_ratio=blend.recompute_ratio,
        seconds=time.perf_counter() - started,
    )
    return blended, share


def _question(segments: Sequence[Segment]) -> list[int]:
    """A request's query rows' tokens: its fresh text after its last chunk (what the probe scores by)."""
    plan = FusionPlan.from_segments(list(segments))
    return plan.token_ids[query_positions(plan)].tolist()


@torch.inference_mode()
def _blended_chunks(fusor: Fusor, blend: FusionResult) -> dict[tuple[tuple[int, ...], int], ChunkKV]:
    """Each chunk's K/V out of the round's fused cache, keys rotated back to the chunk's positions 0..n-1
    (as chunk KV is stored), in the compute dtype."""
    model, cache, plan = fusor.model, blend.cache, blend.plan
    out: dict[tuple[tuple[int, ...], int], ChunkKV] = {}
    for (start, end), key in zip(plan.spans, _occurrences(plan.segments), strict=True):
        if key is None:
            continue
        local = torch.arange(end - start, device=model.device)
        tables = model.rope.rerotation(local + start, local, torch.float32)
        keys = []
        for layer in range(model.num_layers):
            placed = cache.keys[layer][0, :, start:end]
            keys.append(torch.empty_like(placed))
            Rope.apply_rerotation_into(keys[-1], placed, tables)
        values = [cache.values[layer][0, :, start:end].clone() for layer in range(model.num_layers)]
        out[key] = ChunkKV(keys, values, model.fingerprint)
    return out


def _occurrences(segments: Sequence[Segment]) -> list[tuple[tuple[int, ...], int] | None]:
    """Per segment, (its chunk's token ids, which occurrence of that chunk it is) or None for any other
    segment: a chunk that appears twice in a prompt has a blend per occurrence (each behind other text)."""
    seen: dict[tuple[int, ...], int] = {}
    keys: list[tuple[tuple[int, ...], int] | None] = []
    for segment in segments:
        if _is_chunk(segment):
            seen[segment.token_ids] = seen.get(segment.token_ids, -1) + 1
            keys.append((segment.token_ids, seen[segment.token_ids]))
        else:
            keys.append(None)
    return keys


def _member(
    request: FusionRequest,
    blended: dict[tuple[tuple[int, ...], int], ChunkKV],
    share: RoundShare,
    provider_for: ProviderFactory,
) -> tuple[FusionRequest, RoundShare]:
    """A request of the round with its chunks' KV replaced by the round's blend (exact: not recomputed
    again), and its share of the round."""
    segments = [
        s if key is None else replace(s, kv=blended[key], exact=True)
        for s, key in zip(request.segments, _occurrences(request.segments), strict=True)
    ]
    shared = sum(len(s) for s in request.segments if _is_chunk(s))
    job = FusionRequest(
        segments,
        request.method,
        provider_for([s.kv for s in segments if s.kv is not None]),
        request.extra_capacity,
        request.observer,
    )
    return job, RoundShare(
        share.requests, shared, share.round_recomputed_tokens, share.recompute_ratio, share.seconds
    )
