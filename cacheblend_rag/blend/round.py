"""Rounds: requests that read the same cached chunks share one blend of them.

When N requests (agents, users) read the same retrieved chunks at once, per-request fusion loads,
places, probes and recomputes the same chunks N times. A round does that once:

1. requests fused with equal methods whose cached chunks are the same (in any order, at any offset)
   form a round of two or more; the method's :meth:`~.methods.RecomputeMethod.round_sharing` may narrow
   it to requests whose text up to their last chunk is the same (cacheblend at r = 1, so every request
   still gets exactly its own full prefill), to requests whose chunks come in the same order (cacheblend
   with its chunk-shift correction, on by default: the shift a chunk's tokens get is what the passages
   before it changed, so it holds for that order only) or rule rounds out;
2. the round's prompt is its first request's text up to and including its last chunk. A method that
   selects by the question's attention gets one probe of that prompt followed by every request's
   question (at most :data:`PROBE_QUESTIONS` of them, spread over the round), so the selection is scored
   for the round (the sum of its questions' attention) and the budget is r of the round's cached tokens,
   not r per request;
3. the round's prompt is fused once (that probe as its own: the chunks placed once, by the probe), into a
   cache with room for every member's own tokens after it; without logits (each member computes its own),
   so its last token, a chunk's, is not recomputed unless selected, as in each member's own prompt;
4. every request is then computed over that one cache (:mod:`.round_members`): its own text (before,
   between or after the chunks) with exact attention over the round's blended chunks, marked exact so
   nothing in them is recomputed again. A member whose chunks all sit at one shift from the round's
   prompt (the same order behind its own text) is computed at positions shifted back by it, so the blend
   is neither copied nor re-rotated per member; all such members of a round are one pass, their
   projections and MLPs batched with every other request of the batch. Any other member (its own chunk
   order) is fused as a request of its own over its chunks' blend taken out of the round's cache, keys
   rotated back to 0..n-1 and re-rotated to where it has them. A request without a round is fused as it
   would be alone; all of them together in one batch.

Memory: the round's blended KV is held once, in the round's cache, until the members' KV is written where
it is kept: a joining member's result keeps only its own tokens' K/V and writes its chunks' K/V (rotated
to its positions) straight from the round's cache into the decode batch's row, or into its own cache when
that is asked for (:attr:`FusionResult.cache`). During decode each row holds its own copy: the decode
batch is one [rows, Hkv, capacity, d] buffer per layer, and keys rotated to different positions cannot
be shared. Rows could share one copy only where their chunks sit at the same positions (equal text before
them) and a decode kernel read shared prefix slots; neither is done yet.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from ..models.rope import Rope
from .fusor import FusionRequest, FusionResult, FusionRoute, Fusor, RoundShare
from .methods import RoundSharing
from .plan import FusionPlan
from .probe import query_positions
from .round_members import MemberLayout, MembersPass, layout, own_spans
from .segments import ChunkKV, ChunkKVSource, DirectLayerKV, LayerKVProvider, Segment, kv_sources

# Where a pass of the round reads its cached layers from (the engine passes its pipelined loader).
ProviderFactory = Callable[[Sequence[ChunkKVSource]], LayerKVProvider]

# The most members' questions one round's probe scores its selection by. The selection's budget is the
# round's (r of the shared tokens), so past a few questions each further one moves it little (16 agents:
# first-token KL 0.0387 with 8 probed, 0.0384 with all), while its probe rows cost as much as computing
# that question again (each member's question is computed exactly over the blend after it): unbounded, a
# round's time grew about twice as fast as its members' own text. With more members the probed ones are
# spread evenly over the round. See docs/rounds.md.
PROBE_QUESTIONS = 8


def _is_chunk(segment: Segment) -> bool:
    return segment.is_cached and not segment.exact


def _last_chunk(segments: Sequence[Segment]) -> int:
    return max(i for i, s in enumerate(segments) if _is_chunk(s))


def plan_rounds(requests: Sequence[FusionRequest]) -> list[list[int]]:
    """Indices of the requests that form each round (two or more each, first request first)."""
    groups: dict[tuple, list[int]] = {}
    for i, request in enumerate(requests):
        sharing = request.method.round_sharing()
        chunks = tuple(s.token_ids for s in request.segments if _is_chunk(s))
        if sharing is RoundSharing.NONE or not chunks:
            continue
        if sharing is not RoundSharing.SAME_ORDER:
            chunks = tuple(sorted(chunks))  # the same chunks in any order
        key: tuple = (request.method, chunks)
        if sharing is RoundSharing.SAME_PREFIX:
            segments = request.segments[: _last_chunk(request.segments) + 1]
            key += (tuple(t for s in segments for t in s.token_ids),)
        groups.setdefault(key, []).append(i)
    return [members for members in groups.values() if len(members) > 1]


def fuse_round(
    fusor: Fusor, routes: Sequence[FusionRoute], provider_for: ProviderFactory = DirectLayerKV
) -> list[FusionResult]:
    """Fuse the routed requests together, each round of them (:func:`plan_rounds`) sharing one blend of
    its chunks; results in order, each carrying its :class:`RoundShare` when it had one."""
    requests = [route.request for route in routes]
    jobs: dict[int, FusionRoute] = dict(enumerate(routes))  # fused as requests of their own
    passes: list[tuple[MembersPass, list[int]]] = []
    shares: dict[int, RoundShare] = {}
    try:
        for members in plan_rounds(requests):
            for i in members:
                del jobs[i]
            joined, apart = _blend_round(fusor, [requests[i] for i in members], provider_for)
            if joined is not None:
                passes.append((joined, [members[j] for j in range(len(members)) if j not in apart]))
            for j, (job, share) in apart.items():
                jobs[members[j]], shares[members[j]] = fusor.route(job), share
    except BaseException:
        for members_pass, _ in passes:
            members_pass.close()
        raise
    order = sorted(jobs)
    results: dict[int, FusionResult] = {}
    if order or passes:
        # a request fused on its own gets its loader only now: one made for every request up front
        # would read layers of chunks the round serves (the members' are never asked for)
        own = [replace(jobs[i], request=_with_provider(jobs[i].request, provider_for)) for i in order]
        try:
            fused = fusor.fuse_routes(own, also=[p for p, _ in passes])
        except BaseException:
            for job in own:
                job.request.kv_provider.close()  # closed once run; unrun ones here
            raise
        finally:
            for members_pass, _ in passes:
                members_pass.close()
        results.update(zip(order, fused, strict=True))
    for members_pass, indices in passes:
        results.update(zip(indices, members_pass.results(), strict=True))
    for i, share in shares.items():
        results[i].round = share
    return [results[i] for i in range(len(requests))]


def _with_provider(request: FusionRequest, provider_for: ProviderFactory) -> FusionRequest:
    if request.kv_provider is not None:
        return request
    return replace(request, kv_provider=provider_for(kv_sources(request.segments)))


def _blend_round(
    fusor: Fusor, members: list[FusionRequest], provider_for: ProviderFactory
) -> tuple[MembersPass | None, dict[int, tuple[FusionRequest, RoundShare]]]:
    """The round's one probe and blend; the pass of the members that join it over the round's cache
    (:mod:`.round_members`) and, by member index, those fused as requests of their own (over their chunks'
    blend taken out of the round's cache) with their shares."""
    started = time.perf_counter()
    lead = members[0]
    segments = list(lead.segments[: _last_chunk(lead.segments) + 1])
    sources = kv_sources(segments)
    plan = FusionPlan.from_segments(segments)
    starts = {key: start for (start, _), key in zip(plan.spans, _occurrences(segments), strict=True) if key}
    joining = {j: found for j, m in enumerate(members) if (found := _joins(m, starts)) is not None}
    # a method that probes gets the probe of the round's prompt followed by every member's question, as
    # the blend's own probe (which leaves the chunks placed in the blend's cache: placed once)
    questions: tuple[int, ...] = ()
    if plan.num_cached and lead.method.uses_query_attention(plan):
        questions = tuple(t for m in probed_members(members) for t in _question(m.segments))
    # the lead's own loader serves exactly these cached segments, in order
    provider = lead.kv_provider if lead.kv_provider is not None else provider_for(sources)
    room = sum(found[2].numel() for found in joining.values())  # the joining members' own tokens
    # no logits: the blend's last token is a chunk's, a candidate like in each member's own prompt, so
    # the round recomputes as many cached tokens as each member alone would (not one more)
    request = FusionRequest(segments, lead.method, provider, room, probe_suffix=questions, logits=False)
    try:
        blend = fusor.fuse_many([request])[0]
    except BaseException:
        provider.close()  # fuse_many closes it once it ran; not when the prompt was refused
        raise
    for member in members[1:]:  # their chunks come from the round: nothing of theirs is read
        if member.kv_provider is not None:
            member.kv_provider.close()
    recomputable = blend.plan.cached_mask & ~blend.plan.exact_mask
    share = RoundShare(
        requests=len(members),
        shared_tokens=0,  # per member
        round_recomputed_tokens=int(recomputable[blend.selected].sum()),
        recompute_ratio=blend.recompute_ratio,
        seconds=time.perf_counter() - started,
    )
    layouts = []
    for j, (member_plan, (delta, spans), own_positions) in joining.items():
        occurrences = _occurrences(members[j].segments)
        own, own_sources = own_spans(member_plan.segments, member_plan, occurrences)
        layouts.append(
            MemberLayout(
                member_plan,
                members[j].method,
                DirectLayerKV(own_sources),  # a template's opening, in memory: no loader thread each
                delta,
                spans,
                own,
                own_positions,
                member_plan.must_compute.nonzero().squeeze(1),
                members[j].extra_capacity,
                _share_of(share, members[j]),
            )
        )
    joined = MembersPass(fusor.model, blend.buffer, plan.num_tokens, layouts) if layouts else None
    apart: dict[int, tuple[FusionRequest, RoundShare]] = {}
    if len(joining) < len(members):
        blended = _blended_chunks(fusor, blend)
        for j, member in enumerate(members):
            if j not in joining:
                apart[j] = (_member(member, blended, provider_for), _share_of(share, member))
    return joined, apart


def _joins(
    member: FusionRequest, starts: dict[tuple[tuple[int, ...], int], int]
) -> tuple[FusionPlan, tuple[int, list], torch.Tensor] | None:
    """A member's plan (its chunks marked exact), its chunks' shift and spans and its own positions, when
    it can join the round's pass (:func:`.round_members.layout`); None when it is fused on its own."""
    if member.observer is not None:  # an observer expects a prompt's own attention
        return None
    occurrences = _occurrences(member.segments)
    segments = [
        s if key is None else replace(s, exact=True)
        for s, key in zip(member.segments, occurrences, strict=True)
    ]
    plan = FusionPlan.from_segments(segments)
    found = layout(plan, occurrences, starts, member.method)
    if found is None:
        return None
    own = torch.ones(plan.num_tokens, dtype=torch.bool)
    for _, (start, end) in found[1]:
        own[start:end] = False
    return plan, found, own.nonzero().squeeze(1)


def _share_of(share: RoundShare, member: FusionRequest) -> RoundShare:
    shared = sum(len(s) for s in member.segments if _is_chunk(s))
    return RoundShare(
        share.requests, shared, share.round_recomputed_tokens, share.recompute_ratio, share.seconds
    )


def probed_members(members: Sequence[FusionRequest]) -> list[FusionRequest]:
    """The members whose questions the round's probe scores: all of them up to :data:`PROBE_QUESTIONS`,
    else that many spread evenly over the round (the first always among them)."""
    if len(members) <= PROBE_QUESTIONS:
        return list(members)
    return [members[i * len(members) // PROBE_QUESTIONS] for i in range(PROBE_QUESTIONS)]


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
    provider_for: ProviderFactory,
) -> FusionRequest:
    """A request of the round with its chunks' KV replaced by the round's blend (exact: not recomputed
    again), fused as a request of its own."""
    segments = [
        s if key is None else replace(s, kv=blended[key], exact=True)
        for s, key in zip(request.segments, _occurrences(request.segments), strict=True)
    ]
    return FusionRequest(
        segments,
        request.method,
        provider_for(kv_sources(segments)),
        request.extra_capacity,
        request.observer,
    )
