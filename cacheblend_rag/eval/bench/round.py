"""Section ``round``: N agents reading the same chunks in one round.

Each agent's prompt is its own role (a system message of 20-80 tokens, different per agent), the same 6
MuSiQue chunks and its own question. Timed through the batch scheduler, all agents arriving at once:
(a) full prefill, (b) per-request cacheblend with batched fusion (rounds off), (c) the round; the time
until every agent has its first token and requests/s with ``throughput_max_new_tokens`` new tokens each,
median of ``repeats``; (b) and (c) again with each agent's own chunk order. Then fidelity per agent
against its own full prefill on held-out MuSiQue rounds (each case's chunks, 8 agents asking its question
in 8 roles): first-token KL and agreement of per-request cacheblend and of the round at the same r.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...blend.round import PROBE_QUESTIONS
from ...blend.spec import parse_method
from ...engine import BatchScheduler, Engine, GenerationRequest, GenerationResult, SamplingParams
from ...engine.fidelity import store_in_ram
from ...engine.prompt import ChunkRef, PromptBuilder
from ...records import OpenRecord
from ...store.keys import kv_bytes_per_token
from ..datasets import load_dataset, select_cases
from ..engines import QA_TEMPLATE
from ..markdown import fmt, table
from ..metrics import kl_divergence
from .config import BenchContext
from .page import Page, checks_lines
from .prompts import eval_corpus, eval_engine, rag_prompts
from .record import Check

logger = logging.getLogger(__name__)

# Sixteen agents' roles, 20-80 tokens each with the default tokenizer (tests/eval check the range).
ROLES = (
    "You are a research assistant. Answer the question using only the passages, in one short sentence.",
    "You are a fact checker for a newspaper. Read the passages and give the single fact asked for.",
    "You are a librarian helping a student with homework. Point to what the passages say, briefly and "
    "clearly, without adding anything they do not say.",
    "You are a quiz host. Give the answer only, no explanation.",
    "You are a careful historian. Answer from the passages; if they disagree, say which one you follow.",
    "You are an assistant for a legal team. Quote no more than needed and answer precisely from the "
    "documents provided, naming the passage you rely on.",
    "You are a travel guide writer. Answer the question about places and people from the passages in "
    "plain words a visitor would understand.",
    "You are a data analyst. Extract the entity or number the question asks for from the passages.",
    "You are a teacher preparing an exam key. Write the correct answer as a short phrase.",
    "You are a support agent for a knowledge base. Answer from the retrieved articles only; when they do "
    "not contain the answer, say that the articles do not say.",
    "You are a biographer. Answer questions about people's lives from the passages, briefly.",
    "You are a museum curator answering a visitor's question from the exhibit notes below.",
    "You are a news editor checking a reporter's claim against the sources. State the fact from the "
    "sources that answers the question, and nothing else.",
    "You are a concise assistant. One line.",
    "You are a geography tutor. Answer with the place name the passages give, then stop.",
    "You are an archivist. Find the answer in the records below and reply with it in a few words, "
    "keeping the wording of the records where you can.",
)
ROUND_LEVELS = (1, 2, 4, 8, 16)
FULL_PREFILL_LEVELS = (1, 8)  # full prefill is timed where the claims compare against it
FIDELITY_AGENTS = 8


@dataclass(frozen=True)
class RoundTiming(OpenRecord):
    """One runner at one agent count: medians over the repeats, every sample of the time to all first
    tokens, and (from the first repeat) the peak KV, the round's size and the tokens computed by the
    round and by the agents (older results lack the last two)."""

    all_first_tokens_s: float
    requests_per_s: float
    samples_all_first_tokens_s: list[float]
    peak_kv_bytes: int
    round_requests: int
    agent_computed_tokens: int | None = None
    round_recomputed_tokens: int | None = None


@dataclass(frozen=True)
class RoundFidelity(OpenRecord):
    """Mean first-token KL and agreement against each agent's own full prefill, per-request cacheblend vs
    the round (None without cases)."""

    cases: int
    agents: int = FIDELITY_AGENTS
    kl_per_request: float | None = None
    kl_round: float | None = None
    agree_per_request: float | None = None
    agree_round: float | None = None


@dataclass(frozen=True)
class RoundResult(OpenRecord):
    """Timing per runner label and agent count (``str(n)``), fidelity, the claims checked and the bound on
    the questions a round's probe scores."""

    levels: list[int]
    chunks: int
    chunk_tokens: list[int]
    ratio: float
    max_new_tokens: int
    timing: dict[str, dict[str, RoundTiming]]
    fidelity: RoundFidelity
    checks: list[Check]
    probe_questions: int | None = None  # older results lack it


def agent_requests(
    engine: Engine, refs: Sequence[ChunkRef], questions: Sequence[str], method, sampling, own_order: bool
) -> list[GenerationRequest]:
    """One request per question: role i, the chunks (in a per-agent order when ``own_order``)."""
    requests = []
    for i, question in enumerate(questions):
        order = list(refs)
        if own_order:
            random.Random(i).shuffle(order)
        builder = PromptBuilder(engine.model.tokenizer, ROLES[i % len(ROLES)], QA_TEMPLATE)
        requests.append(
            GenerationRequest.of(
                engine.segments(builder.rag_parts(question, order), method), method, sampling
            )
        )
    return requests


def timed_round(engine: Engine, requests: list[GenerationRequest], rounds: bool) -> dict[str, float]:
    """All ``requests`` submitted at once to a scheduler admitting all of them."""
    capacity = max(sum(len(s) for s in r.segments) for r in requests) + 64
    budget = 2 * len(requests) * capacity * kv_bytes_per_token(engine.model.shape, engine.model.dtype)
    with BatchScheduler(engine, max_batch=len(requests), kv_budget_bytes=budget, rounds=rounds) as scheduler:
        started = time.perf_counter()
        handles = scheduler.submit_many(requests)
        results = [h.result() for h in handles]
        done = time.perf_counter() - started
        first = max(h.first_token_at for h in handles) - started
        peak = scheduler.stats.peak_kv_bytes
    return {
        "all_first_tokens_s": first,
        "requests_per_s": len(requests) / done,
        "peak_kv_bytes": peak,
        "round_requests": results[0].round_requests,
        # what was computed: each agent's own (its text; per request also its chunks' recompute) and the
        # round's one recompute of the shared chunks (which each member's computed_tokens counts too)
        "agent_computed_tokens": sum(r.computed_tokens - r.round_recomputed_tokens for r in results),
        "round_recomputed_tokens": results[0].round_recomputed_tokens,
    }


def _median(samples: list[dict[str, Any]]) -> RoundTiming:
    first = samples[0]
    return RoundTiming(
        all_first_tokens_s=statistics.median(s["all_first_tokens_s"] for s in samples),
        requests_per_s=statistics.median(s["requests_per_s"] for s in samples),
        samples_all_first_tokens_s=[s["all_first_tokens_s"] for s in samples],
        peak_kv_bytes=first["peak_kv_bytes"],
        round_requests=first["round_requests"],
        agent_computed_tokens=first["agent_computed_tokens"],
        round_recomputed_tokens=first["round_recomputed_tokens"],
    )


def section_round(ctx: BenchContext) -> RoundResult:
    config = ctx.config
    engine = eval_engine(ctx)
    sampling = SamplingParams(max_tokens=config.throughput_max_new_tokens)
    blend = parse_method("cacheblend").with_ratio(config.ratio)
    # the default's chunk-shift correction is right for one chunk order only, so it shares a round only
    # between agents whose chunks come in the same order; agents that each keep their own order share one
    # only without it (docs/rounds.md)
    any_order = parse_method("cacheblend@shift=false").with_ratio(config.ratio)
    levels = [n for n in ROUND_LEVELS if n <= config.round_max_agents]
    try:
        prompts = rag_prompts(engine, config, max(levels) + 1)
        refs, questions = prompts[0].refs, [p.question for p in prompts[1:]]
        store_in_ram(engine, questions[0], refs)
        timing: dict[str, dict[str, RoundTiming]] = {}
        runners = {
            "full_prefill": ("full_recompute", False, False),
            "per_request": (blend, False, False),
            "round": (blend, True, False),
            "per_request_own_order": (any_order, False, True),
            "round_own_order": (any_order, True, True),
        }
        # interleaved: at each N, every repeat runs each runner once in turn, so that a drift of the
        # machine's speed during the run touches all runners alike
        for n in levels:
            batches = {
                label: (agent_requests(engine, refs, questions[:n], method, sampling, own_order), rounds)
                for label, (method, rounds, own_order) in runners.items()
                if label != "full_prefill" or n in FULL_PREFILL_LEVELS
            }
            samples: dict[str, list[dict[str, Any]]] = {label: [] for label in batches}
            for _ in range(config.repeats):
                for label, (batch, rounds) in batches.items():
                    samples[label].append(timed_round(engine, batch, rounds))
            for label, runs in samples.items():
                timing.setdefault(label, {})[str(n)] = _median(runs)
                logger.info("round: %s at N=%d: %s", label, n, timing[label][str(n)].all_first_tokens_s)
        logger.info("round: timing done; fidelity on %d held-out rounds", config.round_fidelity_cases)
        fidelity = _fidelity(engine, config, blend)
    finally:
        engine.store.close()
    return RoundResult(
        levels=levels,
        chunks=len(refs),
        chunk_tokens=[len(r.token_ids) for r in refs],
        ratio=config.ratio,
        max_new_tokens=config.throughput_max_new_tokens,
        timing=timing,
        fidelity=fidelity,
        checks=round_checks(timing, fidelity),
        probe_questions=PROBE_QUESTIONS,
    )


def _fidelity(engine: Engine, config, blend) -> RoundFidelity:
    """Per agent, first-token KL and agreement against its own full prefill: per-request cacheblend vs the
    round, on ``round_fidelity_cases`` held-out MuSiQue cases (8 roles asking each case's question)."""
    dataset = load_dataset("musique-heldout")
    method, full = blend.build(), parse_method("full_recompute").build()
    rows: dict[str, list[float]] = {
        "kl_per_request": [],
        "kl_round": [],
        "agree_per_request": [],
        "agree_round": [],
    }
    with eval_corpus(engine, dataset, config) as corpus:
        for case in select_cases(dataset.cases, config.round_fidelity_cases, seed=0):
            retrieved, _ = corpus.retrieve(case, config.top_k, "qa")
            refs = [ChunkRef(r.token_ids) for r in retrieved]
            questions = [case.question] * FIDELITY_AGENTS
            # each through the scheduler users are served by: the first token's distribution of every
            # agent by full prefill, fused per request (no rounds) and as one round
            requests = agent_requests(engine, refs, questions, method, FIRST_TOKEN, own_order=False)
            fresh = agent_requests(engine, refs, questions, full, FIRST_TOKEN, own_order=False)
            agents = len(requests)
            references = engine.generate_batch(fresh, max_batch=agents, rounds=False)
            per_request = engine.generate_batch(requests, max_batch=agents, rounds=False)
            rounded = engine.generate_round(requests)
            for reference, alone, shared in zip(references, per_request, rounded, strict=True):
                expected, own, blended = (first_token(r) for r in (reference, alone, shared))
                top = int(expected.argmax())
                rows["kl_per_request"].append(kl_divergence(expected, own))
                rows["kl_round"].append(kl_divergence(expected, blended))
                rows["agree_per_request"].append(float(int(own.argmax()) == top))
                rows["agree_round"].append(float(int(blended.argmax()) == top))
    return RoundFidelity(
        cases=config.round_fidelity_cases,
        agents=FIDELITY_AGENTS,
        **{k: statistics.fmean(v) if v else None for k, v in rows.items()},
    )


# one token with its distribution: what the round's fidelity compares
FIRST_TOKEN = SamplingParams(max_tokens=1, diagnostics=True)


def first_token(result: GenerationResult) -> torch.Tensor:
    """The first token's log-probabilities an answer's diagnostics carry."""
    assert result.diagnostics is not None
    return result.diagnostics.first_token_logprobs


def round_checks(timing: dict[str, dict[str, RoundTiming]], fidelity: RoundFidelity) -> list[Check]:
    checks = []
    at8 = {label: rows.get("8") for label, rows in timing.items()}
    if at8["round"] and at8["per_request"]:
        value = at8["per_request"].all_first_tokens_s / at8["round"].all_first_tokens_s
        checks.append(
            Check(
                "N = 8: the round >= 3x faster than per-request cacheblend to all first tokens",
                value >= 3,
                value,
            )
        )
    if at8["round"] and at8["full_prefill"]:
        value = at8["full_prefill"].all_first_tokens_s / at8["round"].all_first_tokens_s
        checks.append(
            Check("N = 8: the round >= 10x faster than full prefill to all first tokens", value >= 10, value)
        )
    at16 = timing["round"].get("16")
    if at8["round"] and at16:
        # doubling the agents adds only their own text to compute (the shared chunks' recompute is the
        # round's, once): the time may grow by at most the share of computed tokens that adds
        def computed(row: RoundTiming) -> int:
            return row.round_recomputed_tokens + row.agent_computed_tokens

        growth = at16.all_first_tokens_s / at8["round"].all_first_tokens_s - 1
        allowed = computed(at16) / computed(at8["round"]) - 1
        checks.append(
            Check(
                "N = 8 -> 16: the round's time to all first tokens grows by at most the agents' "
                f"own tokens' share (+{allowed:.0%} computed tokens)",
                growth <= allowed,
                growth,
            )
        )
    if fidelity.cases:
        # the claim is over 20 rounds: fewer are named as such
        rounds = f"{fidelity.cases} rounds" + ("" if fidelity.cases >= 20 else ", of the 20 asked")
        gap = fidelity.kl_round - fidelity.kl_per_request
        checks.append(
            Check(f"round first-token KL <= per-request cacheblend's + 0.01 ({rounds})", gap <= 0.01, gap)
        )
        agree = fidelity.agree_round
        checks.append(Check(f"round first-token agreement >= 0.95 ({rounds})", agree >= 0.95, agree))
    return checks


def render_round(page: Page, section: RoundResult) -> list[str]:
    """The section's tables (its renderer, beside its runner)."""
    labels = {
        "full_prefill": "(a) full prefill",
        "per_request": "(b) per-request cacheblend, batched fusion",
        "round": "(c) round",
        "per_request_own_order": "(b) per-request, each agent's own chunk order (shift=false)",
        "round_own_order": "(c) round, each agent's own chunk order (shift=false)",
    }
    rows = []
    for label, title in labels.items():
        for n in section.levels:
            row = section.timing.get(label, {}).get(str(n))
            if row is None:
                continue
            rows.append(
                [
                    title,
                    n,
                    fmt(row.all_first_tokens_s, 2),
                    fmt(row.requests_per_s, 3),
                    f"{row.peak_kv_bytes / 2**20:.0f}",
                    row.round_requests,
                    "-" if row.round_recomputed_tokens is None else row.round_recomputed_tokens,
                    "-" if row.agent_computed_tokens is None else row.agent_computed_tokens,
                ]
            )
    fidelity = section.fidelity
    sizes = ", ".join(map(str, section.chunk_tokens))
    bound = ""
    if section.probe_questions is not None:
        bound = f" (a round's probe scores at most {section.probe_questions} of its questions, spread)"
    return [
        f"{section.chunks} MuSiQue chunks ({sizes} tokens) shared by every agent, each with its own "
        f"role (system message) and question; cacheblend at r = {section.ratio:g}{bound}, for the agents "
        "that each keep their own chunk order without the chunk-shift correction (with it a round is shared "
        "only in one order); "
        f"{section.max_new_tokens} new tokens each; all agents submitted at once to one scheduler; "
        "median of the repeats, the runners interleaved at each N. Peak KV: the decode batch's KV buffer "
        "and, once, each round's cache, which the agents that joined the round's pass decode over in "
        "place (an agent fused apart, such as one with its own chunk order, keeps its own copy of the "
        "blended chunks in its row).",
        "",
        table(
            [
                "runner",
                "agents",
                "all first tokens (s)",
                "requests/s",
                "peak KV (MiB)",
                "round size",
                "recomputed by the round",
                "computed by the agents",
            ],
            rows,
        ),
        "",
        f"Fidelity against each agent's own full prefill, {fidelity.cases} held-out MuSiQue rounds x "
        f"{fidelity.agents} agents: first-token KL per-request {fmt(fidelity.kl_per_request, 4)} vs round "
        f"{fmt(fidelity.kl_round, 4)}; first-token agreement {fmt(fidelity.agree_per_request, 3)} vs "
        f"{fmt(fidelity.agree_round, 3)}.",
        "",
        checks_lines(section.checks),
    ]
