"""CacheBlend's two methods and its typed budgets: ``cacheblend`` (query-aware) and ``cacheblend_hkvd`` (the
paper's deviation selection), each with only its own options; the budget a typed value; every spec users
already write still parsing, to the same label and the same selection (``cacheblend@...,selection=hkvd``
to ``cacheblend_hkvd@...``, with a deprecation warning)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from cacheblend_rag.blend import (
    CacheBlend,
    CacheBlendHKVD,
    CoverBudget,
    FixedBudget,
    MarginBudget,
    Segment,
    available_methods,
    get_method,
    parse_method,
    resolve_method,
)
from cacheblend_rag.blend.plan import FusionPlan, LayerState
from cacheblend_rag.blend.static_layout import DeviationNarrowing, QueryTopK
from cacheblend_rag.errors import MethodOptionError
from cacheblend_rag.eval.bench.ttft import TTFT_COLUMNS
from cacheblend_rag.eval.tune import DEFAULT_VARIANTS
from cacheblend_rag.eval.variants import parse_variant


def scored_plan(seed: int = 0, chunks: int = 3, length: int = 40) -> FusionPlan:
    """Cached chunks then a question, with made-up probe scores; full reuse's next token (the probe's
    logits) sure on even seeds, a tie on odd ones."""
    generator = torch.Generator().manual_seed(seed)
    segments = [Segment.cached(range(1, length + 1), object()) for _ in range(chunks)]
    plan = FusionPlan.from_segments([*segments, Segment.fresh([7, 8, 9])])
    plan.query_attention = torch.rand(plan.num_tokens, generator=generator)
    plan.query_contribution = torch.rand(plan.num_tokens, generator=generator) ** 4
    plan.probe_logits = torch.tensor([0.97, 0.03] if seed % 2 == 0 else [0.5, 0.5]).log()
    return plan


def layer_state(plan: FusionPlan, layer: int, seed: int = 0) -> LayerState:
    generator = torch.Generator().manual_seed(seed)
    candidates = (~plan.exact_mask).nonzero().squeeze(1)

    def kv() -> torch.Tensor:
        return torch.randn(2, candidates.numel(), 8, generator=generator)

    return LayerState(layer, plan, candidates, kv(), kv(), kv(), kv())


def parse_quietly(text: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return parse_method(text)


def test_two_registered_methods():
    assert {"cacheblend", "cacheblend_hkvd"} <= set(available_methods())
    assert type(get_method("cacheblend")) is CacheBlend
    assert type(get_method("cacheblend_hkvd")) is CacheBlendHKVD
    assert set(CacheBlend.model_fields) == {
        "ratio",
        "score",
        "budget",
        "probe_depth",
        "shift",
        "chunk_rows",
        "chunk_starts",
    }
    assert set(CacheBlendHKVD.model_fields) == {"ratio", "signal", "schedule", "shift"}
    assert CacheBlendHKVD().shift  # what cacheblend@selection=hkvd computed: the shift on


@pytest.mark.parametrize(
    ("budget", "flat", "label"),
    [
        (FixedBudget(), {"budget": "fixed"}, "cacheblend@budget=fixed"),
        (CoverBudget(target=0.7), {"budget": "auto", "target": 0.7}, "cacheblend@budget=auto,target=0.7"),
        (
            CoverBudget(target=0.7, min_ratio=0.05),
            {"budget": "cover", "target": 0.7, "min_ratio": 0.05},
            None,
        ),
        (
            MarginBudget(min_ratio=0.15, confident=0.1),
            {"budget": "margin", "confident": 0.1, "min_ratio": 0.15},
            None,
        ),
    ],
)
def test_a_flat_budget_builds_the_typed_one(budget, flat, label):
    method = get_method("cacheblend", ratio=0.5, **flat)
    assert method == CacheBlend(ratio=0.5, budget=budget) == CacheBlend(ratio=0.5, **flat)
    assert method.budget == budget and type(method.budget) is type(budget)
    if label is not None:
        assert parse_method(label).build().budget == budget
        assert parse_method(label).label == label


@pytest.mark.parametrize(
    ("flat", "typed"),
    [
        ("ratio=0.5,budget=auto,target=0.7", CoverBudget(target=0.7)),
        ("ratio=0.5,budget=auto,target=0.3,min_ratio=0.1", CoverBudget(target=0.3, min_ratio=0.1)),
        ("ratio=0.3,budget=margin,min_ratio=0.05,confident=0.1", MarginBudget(min_ratio=0.05, confident=0.1)),
        ("ratio=0.5,budget=margin,min_ratio=0.15,confident=0.9", MarginBudget(min_ratio=0.15, confident=0.9)),
        ("ratio=0.3,budget=fixed", FixedBudget()),
    ],
)
def test_old_flat_specs_select_what_the_typed_budget_selects(flat, typed):
    ratio = float(flat.split(",")[0].removeprefix("ratio="))
    old, new = parse_method(f"cacheblend@{flat}").build(), CacheBlend(ratio=ratio, budget=typed)
    fixed = CacheBlend(ratio=ratio)
    differs = False
    for seed in range(4):
        plan = scored_plan(seed)
        assert torch.equal(old.layer0_positions(plan), new.layer0_positions(plan))
        differs |= not torch.equal(new.layer0_positions(plan), fixed.layer0_positions(plan))
    assert differs == (not isinstance(typed, FixedBudget))  # the budget did choose something
    assert old.probe_logits() == new.probe_logits() == isinstance(typed, MarginBudget)


def test_the_cover_budget_counts_the_tokens_covering_its_target():
    plan = scored_plan()
    plan.query_contribution = torch.zeros(plan.num_tokens)
    plan.query_contribution[[0, 50, 100]] = torch.tensor([6.0, 3.0, 1.0])  # 60 %, 30 %, 10 % of it
    cached = plan.candidate_mask

    def recomputed(budget) -> list[int]:
        picked = CacheBlend(ratio=0.5, budget=budget).layer0_positions(plan)
        return picked[cached[picked]].tolist()

    assert recomputed(CoverBudget(target=0.6, min_ratio=0.0)) == [0]
    assert recomputed(CoverBudget(target=0.9, min_ratio=0.0)) == [0, 50]
    assert len(recomputed(CoverBudget(target=0.6, min_ratio=0.1))) == 12  # 10 % of 120
    assert len(recomputed(FixedBudget())) == 60


def test_the_margin_budget_steps_between_its_two_shares():
    plan = scored_plan()
    plan.probe_logits = torch.tensor([0.9, 0.05, 0.05]).log()  # a lead of 0.85
    sure, unsure = MarginBudget(confident=0.5, min_ratio=0.1), MarginBudget(confident=0.9, min_ratio=0.1)
    assert sure.share(0.4, plan.probe_logits) == 0.1 and unsure.share(0.4, plan.probe_logits) == 0.4
    for budget, ratio in ((sure, 0.1), (unsure, 0.4)):
        picked = CacheBlend(ratio=0.4, budget=budget).layer0_positions(plan)
        assert torch.equal(picked, CacheBlend(ratio=ratio).layer0_positions(plan))


@pytest.mark.parametrize(
    ("options", "needles"),
    [
        ({"budget": "auto", "target": 1.5}, ["budget 'cover'", "target", "1.5"]),
        ({"budget": "auto", "target": 0.0}, ["target", "greater than 0"]),
        ({"budget": "margin", "confident": -1}, ["budget 'margin'", "confident"]),
        ({"budget": "margin", "min_ratio": 2}, ["min_ratio", "got 2"]),
        ({"budget": "auto", "confident": 0.1}, ["budget 'cover' has no option 'confident'"]),
        ({"budget": "margin", "target": 0.7}, ["budget 'margin' has no option 'target'"]),
        ({"target": 0.7}, ["budget 'fixed' has no option 'target'"]),
        ({"budget": "greedy"}, ["no budget 'greedy'", "'auto'"]),
        ({"budget": {"kind": "cover", "target": "much"}}, ["target", "'much'"]),
        ({"budget": "margin", "probe_depth": 4}, ["probe_depth 0"]),
    ],
)
def test_bad_budgets_are_refused_naming_the_option(options, needles):
    with pytest.raises(MethodOptionError) as caught:
        get_method("cacheblend", **options)
    message = str(caught.value)
    assert message.startswith("method 'cacheblend'")
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize(
    ("spec", "option", "other"),
    [
        ("cacheblend@signal=v", "signal", "cacheblend_hkvd@signal=v"),
        ("cacheblend@ratio=0.3,schedule=[[2,1.0]]", "schedule", "cacheblend_hkvd@schedule=[[2,1.0]]"),
        ("cacheblend_hkvd@score=attention", "score", "cacheblend@score=attention"),
        ("cacheblend_hkvd@ratio=0.3,budget=auto", "budget", "cacheblend@budget=auto"),
        ("cacheblend_hkvd@probe_depth=4", "probe_depth", "cacheblend@probe_depth=4"),
        ("cacheblend_hkvd@chunk_rows=4", "chunk_rows", "cacheblend@chunk_rows=4"),
    ],
)
def test_an_option_of_the_other_method_is_refused_with_a_pointer(spec, option, other):
    with pytest.raises(MethodOptionError, match=f"no option '{option}'") as caught:
        parse_method(spec)
    assert other in str(caught.value)
    name, _, _ = spec.partition("@")
    with pytest.raises(MethodOptionError, match=f"'{option}' is an option of"):  # the class itself too
        (CacheBlend if name == "cacheblend" else CacheBlendHKVD)(**{option: "v"})


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("cacheblend@selection=hkvd", "cacheblend_hkvd"),
        ("cacheblend@ratio=0.15,selection=hkvd", "cacheblend_hkvd@0.15"),
        ("cacheblend@selection=hkvd,shift=false", "cacheblend_hkvd@shift=false"),
        ("cacheblend@ratio=0.15,selection=hkvd,signal=v", "cacheblend_hkvd@ratio=0.15,signal=v"),
        (
            "cacheblend@ratio=0.15,selection=hkvd,schedule=[[1,2.0],[3,1.0]]",
            "cacheblend_hkvd@ratio=0.15,schedule=[[1,2.0],[3,1.0]]",
        ),
    ],
)
def test_selection_hkvd_is_an_alias_of_cacheblend_hkvd(old, new):
    with pytest.warns(DeprecationWarning, match="cacheblend_hkvd"):
        aliased = parse_method(old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling warns of nothing
        current = parse_method(new)
    assert aliased == current and aliased.label == new
    method = aliased.build()
    assert method == current.build() and type(method) is CacheBlendHKVD
    plan = scored_plan(chunks=4)
    assert torch.equal(method.layer0_positions(plan), (~plan.exact_mask).nonzero().squeeze(1))
    assert method.check_layers(plan) == current.build().check_layers(plan)
    for layer in method.check_layers(plan):
        state = layer_state(plan, layer)
        assert torch.equal(method.select(state), current.build().select(state))
    static, expected = method.static_selection(plan, 30), current.build().static_selection(plan, 30)
    assert isinstance(static, DeviationNarrowing) and torch.equal(static.positions, expected.positions)
    assert (static.checks, static.signal) == (expected.checks, expected.signal)
    assert not method.uses_query_attention(plan) and not method.probe_logits()


def test_the_alias_also_holds_for_a_name_with_options():
    with pytest.warns(DeprecationWarning, match="deprecated"):
        method = get_method("cacheblend", selection="hkvd", ratio=0.2, shift=False)
    assert method == CacheBlendHKVD(ratio=0.2, shift=False)
    plan = scored_plan()
    with pytest.warns(DeprecationWarning):
        resolved = resolve_method("cacheblend", plan.segments, options={"selection": "hkvd"})
    assert resolved.method == CacheBlendHKVD()
    # selection=query is cacheblend's own: accepted and dropped, from the label too
    assert parse_method("cacheblend@ratio=0.15,selection=query").label == "cacheblend@0.15"
    assert CacheBlend(selection="query") == CacheBlend()
    with pytest.raises(MethodOptionError, match="cacheblend_hkvd"):
        CacheBlend(selection="hkvd")  # a class is one method: it names the other
    with pytest.raises(MethodOptionError, match="selection='foo'"):
        get_method("cacheblend", selection="foo")


def test_hkvd_selects_by_deviation_at_its_check_layers():
    """The deviation rule itself: at the last check layer the ratio share of cached candidates whose
    fresh K deviates most go on (with every must-compute one), before it the schedule's multiple."""
    plan = scored_plan(chunks=4)
    method = CacheBlendHKVD(ratio=0.1, schedule=((1, 3.0), (2, 1.0)))
    state = layer_state(plan, 1)
    kept = method.select(state)
    cached = plan.candidate_mask[kept]
    assert int(cached.sum()) == 48 and plan.must_compute[kept].sum() == plan.must_compute.sum()
    deviation = state.deviation("k")
    best = state.candidates[
        torch.topk(deviation.masked_fill(~plan.candidate_mask[state.candidates], -1), 48).indices
    ]
    assert set(kept[cached].tolist()) == set(best.tolist())
    assert int(plan.candidate_mask[method.select(layer_state(plan, 2))].sum()) == 16
    static = method.static_selection(plan, 30)
    assert isinstance(static, DeviationNarrowing) and static.checks == ((1, 48), (2, 16))
    assert CacheBlendHKVD(signal="kv").static_selection(plan, 30) is None


def test_static_selection_of_query_aware_cacheblend():
    plan = scored_plan()
    assert CacheBlend(ratio=0.1, probe_depth=4).static_selection(plan, 30) == QueryTopK(12, "contribution", 4)
    assert CacheBlend(budget=CoverBudget()).static_selection(plan, 30) is None  # sized by the probe
    assert CacheBlend(budget=MarginBudget()).static_selection(plan, 30) is None
    assert CacheBlend(chunk_rows=2).static_selection(plan, 30) is None


@pytest.mark.parametrize(
    "method",
    [
        CacheBlend(),
        CacheBlend(ratio=0.5, budget=CoverBudget(target=0.7), score="attention"),
        CacheBlend(ratio=0.3, budget=MarginBudget(min_ratio=0.05, confident=0.1)),
        CacheBlendHKVD(),
        CacheBlendHKVD(ratio=0.2, signal="v", schedule=((1, 2.0), (3, 1.0)), shift=False),
    ],
)
def test_options_are_json_and_build_the_same_method(method):
    """What results report (``method_options``) and what the vLLM worker rebuilds the method from."""
    described = json.loads(json.dumps(method.describe()))
    assert described["method"] == method.name
    assert get_method(method.name, **method.options()) == method
    assert get_method(described.pop("method"), **described) == method


def test_a_cover_budget_reports_a_small_dict():
    options = CacheBlend(budget=CoverBudget(target=0.7)).options()
    assert options["budget"] == {"kind": "cover", "target": 0.7, "min_ratio": 0.02}
    assert CacheBlend().options()["budget"] == {"kind": "fixed"}


def test_labels_results_are_keyed_by_stay_as_they_were():
    for label in (
        "cacheblend@0.15",
        "cacheblend@ratio=0.15,shift=false",
        "cacheblend@ratio=0.15,score=attention",
        "cacheblend@ratio=0.5,budget=auto,target=0.7",
        "cacheblend@ratio=0.3,budget=margin,min_ratio=0.05,confident=0.1",
        "cacheblend@ratio=0.5,budget=margin,min_ratio=0.15,confident=0.1",
        "cacheblend@ratio=0.3,probe_depth=6",
    ):
        assert parse_method(label).label == label
    # a typed budget in a spec is labelled as its flat spelling: one computation, one label
    typed = parse_method('cacheblend@ratio=0.5,budget={"kind":"cover","target":0.7}')
    assert typed.label == "cacheblend@ratio=0.5,budget=auto,target=0.7"
    assert typed.build() == parse_method("cacheblend@ratio=0.5,budget=auto,target=0.7").build()
    assert parse_method("cacheblend@budget=auto,target=0.7").with_ratio(0.5).build().budget == CoverBudget(
        target=0.7
    )


def test_the_sweeps_and_benchmarks_name_the_hkvd_method_directly():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        variants = [parse_variant(text) for text in DEFAULT_VARIANTS]
        ttft = parse_method(TTFT_COLUMNS["cacheblend_hkvd"][0])
    assert sum(v.spec.name == "cacheblend_hkvd" for v in variants) == 5
    assert ttft.build() == parse_quietly("cacheblend@selection=hkvd,shift=false").build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = parse_variant("none:cacheblend@ratio=0.15,selection=hkvd")
    assert old == parse_variant("none:cacheblend_hkvd@0.15") and old.label == "none:cacheblend_hkvd@0.15"


def test_chunk_starts_recompute_every_chunks_first_tokens_within_the_budget():
    plan = scored_plan(chunks=3, length=40)
    starts = CacheBlend(ratio=0.25, chunk_starts=4).layer0_positions(plan)
    plain = CacheBlend(ratio=0.25).layer0_positions(plan)
    assert starts.numel() == plain.numel()  # the same budget: 30 of 120 cached tokens
    for start, _ in plan.chunk_spans():
        assert set(range(start, start + 4)) <= set(starts.tolist())
    assert not torch.equal(starts, plain)
    # a budget too small for every chunk's N gives each the same fewer
    few = CacheBlend(ratio=0.05, chunk_starts=4).layer0_positions(plan)
    cached = few[plan.candidate_mask[few]].tolist()
    assert cached == [0, 1, 40, 41, 80, 81]
    assert CacheBlend(chunk_starts=4).static_selection(plan, 30) is None
