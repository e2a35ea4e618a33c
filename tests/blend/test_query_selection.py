"""Query-aware selection (cacheblend's default): the probe pass, what it selects and what it costs."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from cacheblend_rag.blend import CacheBlend, CacheBlendHKVD, FullReuse, Fusor, RecomputeMethod, Segment
from cacheblend_rag.blend.probe import (
    attention_output,
    grouped_causal_mask,
    query_positions,
    query_probabilities,
)
from cacheblend_rag.blend.segments import ChunkContext, prefill_chunk_kv
from cacheblend_rag.engine.prompt import ChunkRef, PromptBuilder
from cacheblend_rag.eval.metrics import kl_divergence
from cacheblend_rag.models.attention import AttentionMask
from cacheblend_rag.models.tokenizer import chunk_context_ids
from cacheblend_rag.text.chunker import Chunker

from .test_fusor import flat_ids

DATA_DIR = Path(__file__).parent.parent / "data"


@pytest.fixture(scope="module")
def cases():
    return json.loads((DATA_DIR / "musique_24.json").read_text())


def rag_prompts(model, cases, chunk_tokens: int, kv_dtype: torch.dtype) -> list:
    """Real RAG prompts of up to six ``chunk_tokens``-token chunks per case (each case's paragraphs cut by
    the ingest chunker), chunk KV precomputed behind the neutral chunk context and held in ``kv_dtype``,
    each with its full-prefill logits."""
    tok = model.tokenizer
    context = ChunkContext(chunk_context_ids(tok, "neutral"))
    chunker = Chunker(tok, chunk_tokens)
    out = []
    for case in cases:
        text = "\n\n".join(c["title"] + "\n" + c["text"] for c in case["ctxs"])
        chunks = [
            ChunkRef(c.token_ids, None, prefill_chunk_kv(model, c.token_ids, context).to(kv_dtype))
            for c in chunker.split(text)[:6]
        ]
        segments = PromptBuilder(tok).rag_segments(case["question"], chunks)
        logits, _ = model.prefill(flat_ids(segments))
        out.append((segments, logits[0]))
    return out


@pytest.fixture(scope="module")
def prompts(model, cases):
    """Three real RAG prompts of up to six <= 512-token chunks, chunk KV in fp16 (:func:`rag_prompts`)."""
    return rag_prompts(model, cases[:3], 512, torch.float16)


def test_query_selection_recomputes_the_most_attended_tokens_at_every_layer(model, prompts):
    segments, _ = prompts[0]
    qkv_before = model.qkv_token_layers
    fused = Fusor(model).fuse(segments, CacheBlend(ratio=0.15, score="attention"))
    plan = fused.plan
    n, cached = plan.num_tokens, plan.num_cached
    fresh = n - cached
    budget = max(1, math.floor(0.15 * cached + 1e-9))
    layers = model.num_layers
    # the probe computes the fresh text at every layer (its last one only scores: no attention output,
    # no MLP); then fresh text + budget at every layer (the last one attending only the last token:
    # nothing reads the others' outputs there)
    assert fused.probe_token_layers == fresh * (layers - 1)
    assert fused.attended_tokens_per_layer == [fresh + budget] * (layers - 1) + [1]
    assert model.qkv_token_layers - qkv_before == fresh * layers + (fresh + budget) * layers
    assert fused.reused_tokens == cached - budget
    # the selected cached tokens are exactly the top-budget of the probe's attention
    attention = plan.query_attention
    assert attention is not None and attention.shape == (n,)
    candidates = (~plan.must_compute).nonzero().squeeze(1)
    expected = set(candidates[torch.topk(attention[candidates], budget).indices].tolist())
    chosen = set(fused.selected.tolist()) - set(plan.must_compute.nonzero().squeeze(1).tolist())
    assert chosen == expected
    # the probe's query rows are the fresh text after the last chunk, ending at the last token
    rows = query_positions(plan)
    assert int(rows[-1]) == n - 1 and int(rows[0]) == plan.cached_spans()[-1][1]
    # its attention is a distribution per head and query row, summed over them and over layers
    heads = model.shape.num_heads
    assert float(attention.sum()) == pytest.approx(heads * rows.numel() * layers, rel=1e-4)
    assert fused.compute_fraction < 0.3


def test_contribution_score_ranks_by_attention_times_value_norm(model, prompts):
    segments, _ = prompts[0]
    fused = Fusor(model).fuse(segments, CacheBlend(ratio=0.15))  # the default score
    plan = fused.plan
    budget = max(1, math.floor(0.15 * plan.num_cached + 1e-9))
    candidates = plan.candidate_mask.nonzero().squeeze(1)
    expected = set(candidates[torch.topk(plan.query_contribution[candidates], budget).indices].tolist())
    chosen = set(fused.selected.tolist()) - set(plan.must_compute.nonzero().squeeze(1).tolist())
    assert chosen == expected
    by_attention = set(candidates[torch.topk(plan.query_attention[candidates], budget).indices].tolist())
    assert chosen != by_attention  # the value norms change the ranking


def test_query_selection_tracks_full_prefill_better_than_reuse_and_hkvd(model, prompts):
    fusor = Fusor(model)
    kl = {"query": 0.0, "hkvd": 0.0, "full_reuse": 0.0}
    for segments, reference in prompts:
        for label, method in (
            ("query", CacheBlend(ratio=0.15)),
            ("hkvd", CacheBlendHKVD(ratio=0.15)),
            ("full_reuse", FullReuse()),
        ):
            kl[label] += kl_divergence(reference, fusor.fuse(segments, method).logits) / len(prompts)
    assert kl["query"] < 0.5 * kl["full_reuse"], kl
    assert kl["query"] < kl["hkvd"], kl


def test_query_selection_is_monotone_in_the_ratio(model, prompts):
    fusor = Fusor(model)
    segments, reference = prompts[1]
    kls = [
        kl_divergence(reference, fusor.fuse(segments, CacheBlend(ratio=r)).logits)
        for r in (0.0, 0.15, 0.5, 1.0)
    ]
    assert kls[-1] < 1e-6, kls
    assert all(later <= earlier + 0.02 for earlier, later in itertools.pairwise(kls)), kls


def test_probe_attention_comes_from_the_probabilities_it_records(model):
    """The probe's fresh rows attend through the probabilities it sums: each row's are a distribution
    over the keys it may see, and times the values they give the model's attention kernel's output."""
    generator = torch.Generator().manual_seed(3)
    n = 900
    positions = torch.cat([torch.tensor([120, 431, 650]), torch.arange(860, n)])  # separators, question
    m, shape = positions.numel(), model.shape
    heads, kv_heads, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    q = torch.randn(1, heads, m, d, generator=generator)
    keys = torch.randn(1, kv_heads, n, d, generator=generator)
    values = torch.randn(1, kv_heads, n, d, generator=generator)
    mask = grouped_causal_mask(positions, n, model.shape)
    probabilities = query_probabilities(q[0], keys[0], mask, model.scaling)
    assert probabilities.shape == (kv_heads, heads // kv_heads, m, n)
    visible = torch.arange(n)[None, :] <= positions[:, None]
    assert float(probabilities[..., ~visible].abs().max()) == 0.0
    assert (probabilities.sum(dim=-1) - 1).abs().max().item() <= 1e-5
    reference = model.attend(q, keys, values, AttentionMask.for_positions(positions, n))
    assert (attention_output(probabilities, values[0]) - reference).abs().max().item() <= 1e-5


class _Fixed(RecomputeMethod):
    """Recomputes given positions, found by no probe of its own (with cacheblend's chunk-shift correction
    unless ``shift`` is off)."""

    name = "fixed_positions"
    positions: tuple[int, ...]
    shift: bool = True

    def layer0_positions(self, plan):
        return torch.tensor(self.positions)

    def shifts_chunks(self) -> bool:
        return self.shift


def test_a_shallower_probe_scores_its_layers_and_fuses_what_it_selected(model, prompts):
    """probe_depth=N runs the probe over the first N layers: each query row's attention per head sums to
    one per layer it ran, the fusion places the layers it left and equals recomputing its selection
    without any probe; probe_depth = every layer is the default exactly."""
    segments, _ = prompts[0]
    fusor = Fusor(model)
    shape, layers = model.shape, model.num_layers
    default = fusor.fuse(segments, CacheBlend())
    every = fusor.fuse(segments, CacheBlend(probe_depth=layers))
    assert torch.equal(default.selected, every.selected) and torch.equal(default.logits, every.logits)
    shallow = fusor.fuse(segments, CacheBlend(probe_depth=4))
    fresh = int(shallow.plan.must_compute.sum())
    assert shallow.probe_token_layers == 3 * fresh and default.probe_token_layers == (layers - 1) * fresh
    rows = query_positions(shallow.plan).numel() * shape.num_heads
    assert math.isclose(float(shallow.plan.query_attention.sum()), 4 * rows, rel_tol=1e-4)
    assert math.isclose(float(default.plan.query_attention.sum()), layers * rows, rel_tol=1e-4)
    assert shallow.selected.numel() == default.selected.numel()
    again = fusor.fuse(segments, _Fixed(positions=tuple(shallow.selected.tolist())))
    assert again.probe_token_layers == 0
    assert torch.equal(shallow.logits, again.logits)
    n = shallow.num_tokens
    for layer in (0, 3, 4, layers - 1):  # placed by the probe, and by the fusion after it
        assert torch.equal(shallow.cache.keys[layer][:, :, :n], again.cache.keys[layer][:, :, :n])
        assert torch.equal(shallow.cache.values[layer][:, :, :n], again.cache.values[layer][:, :, :n])


def test_no_cached_chunk_means_no_probe(model):
    ids = model.tokenizer("Just a question, no passages.", add_special_tokens=False)["input_ids"]
    fused = Fusor(model).fuse([Segment.fresh(ids)], CacheBlend())
    assert fused.probe_token_layers == 0
    assert fused.plan.query_attention is None


def test_auto_budget_covers_the_target_share_within_its_bounds():
    from cacheblend_rag.blend import FixedBudget, get_method
    from cacheblend_rag.blend.plan import FusionPlan

    segments = [Segment.cached(range(1, 101), object()), Segment.fresh([7, 8, 9])]
    plan = FusionPlan.from_segments(segments)
    scores = torch.zeros(plan.num_tokens)
    scores[:100] = torch.tensor([50.0, 30.0, 10.0] + [10.0 / 97] * 97)  # three tokens hold 90 %
    plan.query_attention = plan.query_contribution = scores

    def chosen(**options) -> int:
        picked = get_method("cacheblend", budget="auto", **options).layer0_positions(plan)
        return int(plan.cached_mask[picked].sum())

    assert chosen(target=0.5, min_ratio=0.0) == 1  # the first token alone holds 50 %
    assert chosen(target=0.8, min_ratio=0.0) == 2
    assert chosen(target=0.9, min_ratio=0.0) == 3
    assert chosen(target=0.5, min_ratio=0.05) == 5  # at least 5 % of the 100 cached tokens
    assert chosen(target=1.0, ratio=0.2) == 20  # never more than ratio's budget
    # spread attention needs more tokens for the same target
    plan.query_attention = plan.query_contribution = torch.ones(plan.num_tokens)
    assert chosen(target=0.5, min_ratio=0.0, ratio=1.0) == 50
    assert get_method("cacheblend").budget == FixedBudget()  # the default is unchanged


def test_margin_budget_spends_on_answers_that_could_flip():
    """budget=margin: ratio when full reuse's next token leads its second by less than ``confident``,
    min_ratio when it leads by that much or more; without the probe's logits (a round's shared blend)
    ratio's budget."""
    from cacheblend_rag.blend import get_method
    from cacheblend_rag.blend.plan import FusionPlan

    plan = FusionPlan.from_segments([Segment.cached(range(1, 101), object()), Segment.fresh([7, 8, 9])])
    plan.query_attention = plan.query_contribution = torch.rand(plan.num_tokens)
    method = get_method("cacheblend", ratio=0.4, budget="margin", min_ratio=0.1, confident=0.25)
    assert method.probe_logits() and not get_method("cacheblend").probe_logits()

    def logits_with(top: float, second: float) -> torch.Tensor:
        rest = (1.0 - top - second) / 8
        return torch.tensor([top, second] + [rest] * 8).log()

    def chosen(logits: torch.Tensor | None) -> int:
        plan.probe_logits = logits
        return int(plan.cached_mask[method.layer0_positions(plan)].sum())

    assert chosen(logits_with(0.9, 0.05)) == 10  # a lead of 0.85: min_ratio
    assert chosen(logits_with(0.5, 0.2)) == 10  # a lead of 0.3 >= 0.25
    assert chosen(logits_with(0.4, 0.2)) == 40  # a lead of 0.2 < 0.25: ratio
    assert chosen(logits_with(0.4, 0.4)) == 40  # a tie
    assert chosen(None) == 40
    # the same tokens as the fixed ratio of that share
    plan.probe_logits = logits_with(0.9, 0.05)
    fixed = get_method("cacheblend", ratio=0.1).layer0_positions(plan)
    assert torch.equal(method.layer0_positions(plan), fixed)


@pytest.mark.parametrize(
    ("name", "options", "needle"),
    [
        ("cacheblend_hkvd", {}, "'budget' is an option of 'cacheblend'"),
        ("cacheblend", {"probe_depth": 4}, "probe_depth 0"),
    ],
)
def test_margin_budget_rejects_a_probe_that_cannot_give_logits(name, options, needle):
    from cacheblend_rag.blend import get_method
    from cacheblend_rag.errors import MethodOptionError

    with pytest.raises(MethodOptionError, match=needle):
        get_method(name, budget="margin", **options)


def test_margin_probe_gives_full_reuses_first_token_and_sets_the_budget(model, prompts):
    """The probe asked for logits finishes its last layer: its next-token logits are full reuse's (the
    same cached KV, the fresh text computed by the probe's own attention), and the fusion recomputes the
    share the margin budget reads from them."""
    segments, _ = prompts[1]
    fusor = Fusor(model)
    reuse = fusor.fuse(segments, FullReuse())
    method = CacheBlend(ratio=0.5, budget="margin", min_ratio=0.05, confident=1.0)  # never sure: 0.5
    fused = fusor.fuse(segments, method)
    probe_logits = fused.plan.probe_logits
    assert probe_logits is not None and probe_logits.shape == reuse.logits.shape
    torch.testing.assert_close(probe_logits, reuse.logits.float(), atol=2e-4, rtol=1e-4)
    fresh = int(fused.plan.must_compute.sum())
    assert fused.probe_token_layers == model.num_layers * fresh  # the last layer finished too
    assert method.budget.share(method.ratio, probe_logits) == 0.5
    same = fusor.fuse(segments, CacheBlend(ratio=0.5))
    assert torch.equal(fused.selected, same.selected) and torch.equal(fused.logits, same.logits)
    sure = CacheBlend(ratio=0.5, budget="margin", min_ratio=0.05, confident=1e-6)  # always sure: 0.05
    assert torch.equal(
        fusor.fuse(segments, sure).selected, fusor.fuse(segments, CacheBlend(ratio=0.05)).selected
    )
    # a fixed budget asks for no logits and its probe still stops before the last layer's attention
    assert fusor.fuse(segments, CacheBlend()).plan.probe_logits is None


def test_chunk_floor_gives_every_chunk_rows_to_measure_its_shift():
    """chunk_rows=N with the shift on: each chunk's best N tokens come first out of the same budget; where
    every chunk already has that many among the budget's best, the selection is exactly the top tokens."""
    from cacheblend_rag.blend import get_method
    from cacheblend_rag.blend.plan import FusionPlan

    segments = [
        Segment.cached(range(1, 51), object()),
        Segment.fresh([5]),
        Segment.cached(range(51, 101), object()),
        Segment.fresh([7, 8, 9]),
    ]
    plan = FusionPlan.from_segments(segments)
    spans = plan.chunk_spans()
    scores = torch.zeros(plan.num_tokens)
    scores[spans[0][0] : spans[0][1]] = torch.linspace(1.0, 0.5, 50)  # the question reads chunk 0 only
    scores[spans[1][0] : spans[1][1]] = torch.linspace(0.01, 0.001, 50)
    plan.query_attention = plan.query_contribution = scores

    def chosen(**options) -> tuple[int, int]:
        picked = get_method("cacheblend", ratio=0.1, **options).layer0_positions(plan)
        mask = torch.zeros(plan.num_tokens, dtype=torch.bool)
        mask[picked] = True
        assert int((mask & plan.cached_mask).sum()) == 10  # the budget is the same either way
        return tuple(int(mask[start:end].sum()) for start, end in spans)

    assert chosen() == (10, 0)  # the default: no floor
    assert get_method("cacheblend").chunk_rows == 0
    assert chosen(chunk_rows=2) == (8, 2)  # chunk 1's two best tokens, then the best of the rest
    assert chosen(chunk_rows=4) == (6, 4)
    assert chosen(chunk_rows=50) == (5, 5)  # never more than the budget shared out
    assert chosen(chunk_rows=4, shift=False) == (10, 0)  # without the shift there is nothing to measure
    # when every chunk already has its rows among the best, the floor changes nothing
    scores[spans[1][0] : spans[1][0] + 3] = 2.0
    assert chosen(chunk_rows=2) == chosen() == (7, 3)
