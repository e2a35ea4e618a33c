"""Rounds (blend/round.py): requests over the same chunks blended once, on real MuSiQue chunks.

At r = 1 every agent gets exactly its own full prefill; a round of one is today's request; an agent
without the round's chunks goes the normal path; chunks in another order reuse the round's blend; every
method that reuses chunk KV shares rounds, full recompute never does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cacheblend_rag.blend import Fusor, Segment, get_method
from cacheblend_rag.blend import round as round_module
from cacheblend_rag.blend.fusor import FusionRequest
from cacheblend_rag.blend.round import plan_rounds
from cacheblend_rag.blend.round_members import MembersPass
from cacheblend_rag.blend.segments import ChunkContext, prefill_chunk_kv
from cacheblend_rag.models.tokenizer import chunk_context_ids

DATA_DIR = Path(__file__).parent.parent / "data"
CHUNK_TOKENS = 120
QUESTIONS = ["Who founded it?", "When did it happen?", "Where is it located?"]
ROLES = ["You are a careful historian.", "You are a terse fact checker who answers in one line."]


def fuse_round(fusor, requests, *provider):
    """:func:`~cacheblend_rag.blend.round.fuse_round` of ``requests`` routed as the engine routes them."""
    return round_module.fuse_round(fusor, [fusor.route(r) for r in requests], *provider)


@pytest.fixture(scope="module")
def parts(model):
    """Four real MuSiQue chunks (KV precomputed behind the neutral chunk context) and the encoder."""
    tok = model.tokenizer
    case = json.loads((DATA_DIR / "musique_24.json").read_text())[0]
    context = ChunkContext(chunk_context_ids(tok, "neutral"))
    chunks = []
    for ctx in case["ctxs"][:4]:
        ids = tok(ctx["title"] + "\n" + ctx["text"], add_special_tokens=False)["input_ids"][:CHUNK_TOKENS]
        chunks.append(Segment.cached(ids, prefill_chunk_kv(model, ids, context).to(torch.float16)))

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    return chunks, encode


def prompt(parts, question: str, role: str = "", order=(0, 1, 2, 3)) -> list[Segment]:
    chunks, encode = parts
    head = Segment.fresh(encode(f"<|im_start|>system\n{role or 'Answer from the passages.'}<|im_end|>\n"))
    body = []
    for i in order:
        body += [chunks[i], Segment.fresh(encode("\n\n"))]
    tail = Segment.fresh(encode(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"))
    return [head, *body[:-1], tail]


def full_logits(model, segments) -> torch.Tensor:
    return model.prefill([t for s in segments for t in s.token_ids])[0][0]


def kl(logits: torch.Tensor, reference: torch.Tensor) -> float:
    p = torch.log_softmax(reference, -1)
    return float((p.exp() * (p - torch.log_softmax(logits, -1))).sum())


def test_r1_round_of_agents_with_one_prefix_is_each_ones_full_prefill(model, parts):
    agents = [prompt(parts, q) for q in QUESTIONS]
    method = get_method("cacheblend", ratio=1.0)
    results = fuse_round(Fusor(model), [FusionRequest(a, method) for a in agents])
    for agent, result in zip(agents, results, strict=True):
        assert result.round is not None and result.round.requests == 3  # the round was shared
        assert result.round.shared_tokens == 4 * CHUNK_TOKENS
        assert result.round.round_recomputed_tokens == 4 * CHUNK_TOKENS
        assert (result.logits - full_logits(model, agent)).abs().max() <= 1e-4


def test_r1_agents_with_their_own_roles_stay_exact(model, parts):
    # r = 1 promises each agent its own full prefill: text before the chunks differs, so no round
    agents = [prompt(parts, q, role) for q, role in zip(QUESTIONS, ROLES, strict=False)]
    method = get_method("cacheblend", ratio=1.0)
    assert plan_rounds([FusionRequest(a, method) for a in agents]) == []
    results = fuse_round(Fusor(model), [FusionRequest(a, method) for a in agents])
    for agent, result in zip(agents, results, strict=True):
        assert result.round is None
        assert (result.logits - full_logits(model, agent)).abs().max() <= 1e-4


def test_a_round_of_one_is_todays_request(model, parts):
    fusor, method = Fusor(model), get_method("cacheblend")
    agent = prompt(parts, QUESTIONS[0], ROLES[0])
    (alone,) = fuse_round(fusor, [FusionRequest(agent, method)])
    today = fusor.fuse(agent, method)
    assert alone.round is None
    assert torch.equal(alone.logits, today.logits) and torch.equal(alone.selected, today.selected)


def test_roles_orders_and_an_outsider_in_one_batch(model, parts):
    # any chunk order shares a round without the chunk-shift correction (with it: the next test)
    fusor, method = Fusor(model), get_method("cacheblend", shift=False)
    agents = [
        prompt(parts, QUESTIONS[0], ROLES[0]),
        prompt(parts, QUESTIONS[1], ROLES[1], order=(3, 1, 0, 2)),  # its own order: the same round
        prompt(parts, QUESTIONS[2], order=(2, 0, 3, 1)),
    ]
    outsider = prompt(parts, QUESTIONS[0], ROLES[1], order=(0, 1))  # other chunks: the normal path
    results = fuse_round(fusor, [FusionRequest(a, method) for a in [*agents, outsider]])
    reuse = get_method("full_reuse")
    for agent, result in zip(agents, results, strict=False):
        share = result.round
        assert share is not None and share.requests == 3 and share.shared_tokens == 4 * CHUNK_TOKENS
        # one budget for the round: r of its cached tokens, recomputed once for all three
        assert share.round_recomputed_tokens == int(0.15 * 4 * CHUNK_TOKENS)
        assert result.recompute_ratio == share.recompute_ratio
        # nothing of the chunks is recomputed again per agent: only its own text is computed
        fresh = sum(len(s) for s in agent if not s.is_cached)
        assert result.computed_tokens == fresh
        # and the round's blend is a better cache than the chunks as stored
        reference = full_logits(model, agent)
        assert kl(result.logits, reference) < kl(fusor.fuse(agent, reuse).logits, reference)
    alone = fusor.fuse(outsider, method)
    assert results[-1].round is None and torch.equal(results[-1].logits, alone.logits)


def test_with_the_chunk_shift_a_round_is_one_chunk_order(model, parts):
    fusor, method = Fusor(model), get_method("cacheblend")  # the default: shift on
    same = [prompt(parts, QUESTIONS[0], ROLES[0]), prompt(parts, QUESTIONS[1], ROLES[1])]
    reordered = prompt(parts, QUESTIONS[2], order=(2, 0, 3, 1))
    requests = [FusionRequest(a, method) for a in [*same, reordered]]
    assert plan_rounds(requests) == [[0, 1]]
    results = fuse_round(fusor, requests)
    reuse = get_method("full_reuse")
    for agent, result in zip(same, results, strict=False):
        assert result.round is not None and result.round.requests == 2
        reference = full_logits(model, agent)
        assert kl(result.logits, reference) < kl(fusor.fuse(agent, reuse).logits, reference)
    alone = fusor.fuse(reordered, method)
    assert results[-1].round is None and torch.equal(results[-1].logits, alone.logits)


def test_methods_that_share_rounds_and_one_that_cannot(model, parts):
    fusor = Fusor(model)
    agents = [prompt(parts, q, role) for q, role in zip(QUESTIONS, ROLES, strict=False)]
    for method in [get_method("epic"), get_method("full_reuse"), get_method("cacheblend_hkvd")]:
        results = fuse_round(fusor, [FusionRequest(a, method) for a in agents])
        assert all(r.round is not None and r.round.requests == len(agents) for r in results), method.name
    full = get_method("full_recompute")
    fresh = [[Segment.fresh(s.token_ids) for s in a] for a in agents]
    assert plan_rounds([FusionRequest(a, full) for a in fresh]) == []
    # requests with different methods never share one blend
    mixed = [FusionRequest(agents[0], get_method("epic")), FusionRequest(agents[1], get_method("cacheblend"))]
    assert plan_rounds(mixed) == []


def test_members_over_the_rounds_cache_equal_members_fused_on_their_own(model, parts):
    # same chunk order behind roles of different lengths: every member joins the round's one pass,
    # its chunks shifted by its role's length; an attention observer sends a member through the path of a
    # request of its own (its chunks' blend copied out and re-rotated): both must give the same answer
    fusor, method = Fusor(model), get_method("cacheblend")
    agents = [prompt(parts, q, role) for q, role in zip(QUESTIONS, [*ROLES, "Be brief."], strict=True)]
    joined = fuse_round(fusor, [FusionRequest(a, method) for a in agents])
    assert all(r.pending is not None for r in joined)  # their chunks' KV still in the round's cache

    def observer(*_):
        pass

    apart = fuse_round(fusor, [FusionRequest(a, method, observer=observer) for a in agents])
    assert all(r.pending is None for r in apart)
    for one, other in zip(joined, apart, strict=True):
        # a decode batch's row gets the member's KV straight from the round's cache, as its own cache would
        n = one.num_tokens
        batch = model.new_cache(n, batch=2)
        one.write_into(batch.keys, batch.values, 1)
        for layer in range(model.num_layers):
            assert torch.equal(batch.keys[layer][1, :, :n], one.cache.keys[layer][0, :, :n])
            assert torch.equal(batch.values[layer][1, :, :n], one.cache.values[layer][0, :, :n])
        assert one.round.shared_tokens == other.round.shared_tokens
        assert one.round.round_recomputed_tokens == other.round.round_recomputed_tokens
        assert one.computed_tokens == other.computed_tokens
        assert (one.logits - other.logits).abs().max() <= 1e-3
        for layer in (0, model.num_layers - 1):
            for mine, theirs in ((one.cache.keys, other.cache.keys), (one.cache.values, other.cache.values)):
                assert (mine[layer][0, :, :n] - theirs[layer][0, :, :n]).abs().max() <= 1e-3


def test_the_rounds_probe_scores_a_bounded_spread_of_its_questions(model, parts, monkeypatch):
    # past PROBE_QUESTIONS members the probe scores that many questions, spread over the round: four agents
    # under a bound of two get the blend of the round of their first and third agents
    fusor, method = Fusor(model), get_method("cacheblend")
    questions = [*QUESTIONS, "Which river flows through it?"]
    agents = [prompt(parts, q) for q in questions]
    assert round_module.probed_members(list(range(16))) == list(range(0, 16, 2))
    assert round_module.probed_members([1, 2, 3]) == [1, 2, 3]
    every = fuse_round(fusor, [FusionRequest(a, method) for a in agents])  # bound 8: every question
    spread = fuse_round(fusor, [FusionRequest(agents[i], method) for i in (0, 2)])
    monkeypatch.setattr(round_module, "PROBE_QUESTIONS", 2)
    bounded = fuse_round(fusor, [FusionRequest(a, method) for a in agents])
    n = every[0].num_tokens
    start = len(agents[0][0])  # the chunks start after the system head

    def blend(result) -> torch.Tensor:
        return torch.stack(
            [result.cache.keys[layer][0, :, start : n - len(agents[0][-1])] for layer in (1, 20)]
        )

    assert torch.equal(blend(bounded[0]), blend(spread[0]))
    assert not torch.equal(blend(every[0]), blend(spread[0]))  # the other two questions moved the blend
    assert all(r.round.requests == 4 for r in bounded)


def test_members_attention_in_two_parts_equals_one_masked_call(model, parts, monkeypatch):
    # with their heads exact (as the engine lays prompts out) every member row sees the round's chunks, so
    # the members' attention runs as the round's prompt and each member's own slots, merged: it must equal
    # the one masked call over every slot
    fusor, method = Fusor(model), get_method("cacheblend")
    agents = []
    for question, role in zip(QUESTIONS, [*ROLES, "Be brief."], strict=True):
        head, *rest = prompt(parts, question, role)
        agents.append(
            [Segment.cached(head.token_ids, prefill_chunk_kv(model, head.token_ids), exact=True), *rest]
        )
    split = fuse_round(fusor, [FusionRequest(a, method) for a in agents])
    calls = []
    monkeypatch.setattr(MembersPass, "_split", lambda self, dtype: calls.append(dtype))
    whole = fuse_round(fusor, [FusionRequest(a, method) for a in agents])
    assert calls  # the second round ran the one call
    for one, other in zip(split, whole, strict=True):
        assert one.round is not None and one.round.requests == 3
        assert torch.equal(one.selected, other.selected)
        assert (one.logits - other.logits).abs().max() <= 1e-3
        n = one.num_tokens
        for layer in (1, model.num_layers - 1):
            assert (one.cache.keys[layer][0, :, :n] - other.cache.keys[layer][0, :, :n]).abs().max() <= 1e-2
