"""The adaptive budget (the default's): chunks averaging more than ``short_tokens`` get the method's ratio,
exactly as ``cacheblend@<ratio>`` selects; shorter chunks get ``short_extra`` more (exactly as
``cacheblend@<ratio + short_extra>``), or with ``target`` the cover budget within that (exactly as
``cacheblend@ratio=<ratio + short_extra>,budget=auto,target=<target>``); the choice is reported per
request and the static (accelerator) form is kept wherever the choice is a fixed share."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag.blend import AdaptiveBudget, CacheBlend, CoverBudget, FixedBudget, Segment, parse_method
from cacheblend_rag.blend.budget_choice import BudgetChoice
from cacheblend_rag.blend.plan import FusionPlan
from cacheblend_rag.blend.static_layout import QueryTopK
from cacheblend_rag.config import DEFAULT_METHOD
from cacheblend_rag.errors import EvalDataError, MethodOptionError


def plan_of(lengths: list[int], seed: int = 0) -> FusionPlan:
    generator = torch.Generator().manual_seed(seed)
    segments = [Segment.cached(range(1, n + 1), object()) for n in lengths]
    plan = FusionPlan.from_segments([*segments, Segment.fresh([7, 8, 9])])
    plan.query_attention = torch.rand(plan.num_tokens, generator=generator)
    plan.query_contribution = torch.rand(plan.num_tokens, generator=generator) ** 4
    return plan


def test_the_spec_parses_to_the_typed_budget_and_labels_back():
    spec = parse_method("cacheblend@budget=adaptive,short_tokens=160,target=0.8")
    assert spec.build().budget == AdaptiveBudget(short_tokens=160, target=0.8)
    assert parse_method("cacheblend@budget=adaptive,short_extra=0.3").build().budget.short_extra == 0.3
    assert parse_method(spec.label).build() == spec.build()
    assert parse_method("cacheblend@budget=adaptive").build().budget == AdaptiveBudget()
    with pytest.raises(MethodOptionError, match="short_tokens"):
        parse_method("cacheblend@budget=adaptive,short_tokens=-1").build()
    with pytest.raises(MethodOptionError, match="short_extra"):
        parse_method("cacheblend@budget=fixed,short_extra=0.3").build()


def test_the_default_method_is_the_adaptive_one():
    assert isinstance(parse_method(DEFAULT_METHOD).build().budget, AdaptiveBudget)


@pytest.mark.parametrize("seed", range(3))
def test_long_chunks_select_what_the_fixed_ratio_selects(seed):
    plan = plan_of([300, 260, 200], seed)
    for ratio in (0.05, 0.15, 0.3):
        adaptive = CacheBlend(ratio=ratio, budget=AdaptiveBudget())
        fixed = parse_method(f"cacheblend@{ratio}").build()
        assert torch.equal(adaptive.layer0_positions(plan), fixed.layer0_positions(plan))
        assert adaptive.static_selection(plan, 30) == fixed.static_selection(plan, 30)
        assert isinstance(adaptive.static_selection(plan, 30), QueryTopK)


@pytest.mark.parametrize("seed", range(3))
def test_short_chunks_select_what_their_own_share_selects(seed):
    plan = plan_of([128, 128, 100, 90], seed)
    adaptive = CacheBlend(ratio=0.15, budget=AdaptiveBudget(short_extra=0.1))
    own = parse_method("cacheblend@0.25").build()
    assert torch.equal(adaptive.layer0_positions(plan), own.layer0_positions(plan))
    assert adaptive.static_selection(plan, 30) == own.static_selection(plan, 30)
    fixed = parse_method("cacheblend@0.15").build().layer0_positions(plan)
    assert not torch.equal(adaptive.layer0_positions(plan), fixed)  # the choice changed the selection


@pytest.mark.parametrize("seed", range(3))
def test_short_chunks_with_a_target_select_what_the_cover_budget_selects(seed):
    plan = plan_of([128, 128, 100, 90], seed)
    adaptive = CacheBlend(ratio=0.15, budget=AdaptiveBudget(target=0.7, short_extra=0.35))
    cover = parse_method("cacheblend@ratio=0.5,budget=auto,target=0.7").build()
    assert torch.equal(adaptive.layer0_positions(plan), cover.layer0_positions(plan))
    assert adaptive.static_selection(plan, 30) is None  # sized by the probe's scores: the dynamic path


def test_the_threshold_is_the_mean_chunk_length():
    budget = AdaptiveBudget(short_tokens=150)
    assert budget.choose([150] * 4, 0.15) == (FixedBudget(), 0.25)
    assert budget.choose([151] * 4, 0.15) == (FixedBudget(), 0.15)
    assert budget.choose([50, 250], 0.15) == (FixedBudget(), 0.25)  # mean 150
    assert budget.choose([], 0.15) == (FixedBudget(), 0.15)  # nothing blended: nothing to choose for
    assert AdaptiveBudget(target=0.8).choose([100], 0.15) == (CoverBudget(target=0.8), 0.25)
    # the share follows the ratio asked: a sweep stays ordered, a controller's 1 stays 1, 0 stays 0
    assert [budget.choose([100], r)[1] for r in (0.0, 0.05, 0.3, 0.95, 1.0)] == pytest.approx(
        [0.0, 0.15, 0.4, 1.0, 1.0]
    )


def test_the_choice_is_reported_per_request():
    method = parse_method("cacheblend@budget=adaptive,ratio=0.2").build()
    assert method.request_choice([512] * 6) == BudgetChoice(
        kind="fixed", ratio=0.2, short=False, chunks=6, mean_chunk_tokens=512.0
    )
    short = method.request_choice([120, 121])
    # as results and `query --json` report it: a cover budget's options only where it chose one
    assert short.to_dict() == {
        "kind": "fixed",
        "ratio": 0.3,
        "short": True,
        "chunks": 2,
        "mean_chunk_tokens": 120.5,
    }
    assert BudgetChoice.from_dict(short.to_dict()) == short
    covered = parse_method("cacheblend@budget=adaptive,target=0.8").build().request_choice([100] * 4)
    assert list(covered.to_dict()) == [
        "kind",
        "target",
        "min_ratio",
        "ratio",
        "short",
        "chunks",
        "mean_chunk_tokens",
    ]
    assert parse_method("cacheblend@0.15").build().request_choice([120] * 10) is None


def test_a_misspelt_choice_is_refused_by_name():
    with pytest.raises(EvalDataError, match="no field 'ratios'"):
        BudgetChoice.from_dict(
            {"kind": "fixed", "ratios": 0.2, "short": False, "chunks": 1, "mean_chunk_tokens": 9}
        )
    with pytest.raises(EvalDataError, match="lacks field 'ratio'"):
        BudgetChoice.from_dict({"kind": "fixed", "short": False, "chunks": 1, "mean_chunk_tokens": 9})


def test_the_choice_in_words_briefly_and_in_full():
    fixed = parse_method("cacheblend@budget=adaptive,ratio=0.2").build()
    long, short = fixed.request_choice([512] * 6), fixed.request_choice([120, 121])
    assert long.text(brief=True) == "long chunks: 0.2"
    assert short.text(brief=True) == "short chunks: 0.3"
    assert short.text() == "0.3 of the cached tokens (short chunks: 2 averaging 120.5 tokens)"
    cover = parse_method("cacheblend@budget=adaptive,ratio=0.2,target=0.8").build()
    covered = cover.request_choice([100] * 4)
    assert covered.text(brief=True) == "short chunks: cover 0.8 within 0.3"
    assert covered.text() == (
        "those covering 0.8 of the question's attention, at most 0.3 of the cached tokens "
        "(short chunks: 4 averaging 100 tokens)"
    )
    # long chunks get the fixed share even with a target: no cover in the words
    assert cover.request_choice([512] * 2).text(brief=True) == "long chunks: 0.2"
