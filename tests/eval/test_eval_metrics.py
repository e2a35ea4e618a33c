"""Metrics against hand-computed values, and the teacher-forced NLL against a plain full prefill."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from cacheblend_rag.config import DECISIVE_MARGIN
from cacheblend_rag.eval.metrics import (
    agreement_split,
    check_decisive_margin,
    continuation_nll,
    is_decisive,
    kl_divergence,
    log_margin,
    normalize_answer,
    qa_f1,
    rouge_l,
    token_f1,
)


def test_normalize_answer_drops_case_punctuation_articles_and_spaces():
    assert normalize_answer("  The Cat, sat on a MAT!  ") == "cat sat on mat"
    assert normalize_answer("An apple.") == "apple"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words


def test_token_f1_known_values():
    # prediction {cat, sat}; gold {cat, sat, down}: P = 1, R = 2/3
    assert token_f1("the cat sat", "a cat sat down") == pytest.approx(0.8)
    assert token_f1("Paris", "paris.") == 1.0
    assert token_f1("London", "Paris") == 0.0
    assert token_f1("", "Paris") == 0.0
    # repeated tokens count once per occurrence in both
    assert token_f1("x b b", "b b c") == pytest.approx(2 / 3)


def test_qa_f1_takes_the_best_gold_answer():
    assert qa_f1("Exeter College, Oxford", ["Oxford University", "Exeter College"]) == pytest.approx(0.8)
    assert qa_f1("nothing", ["Exeter College"]) == 0.0


def test_rouge_l_is_longbenchs():
    """LongBench scores summaries with the rouge package's Rouge-L F, unnormalised, 0 on failure."""
    from rouge import Rouge

    pairs = [("the cat sat on the mat", "the cat lay on the mat"), ("a b c d", "a x c y d")]
    for prediction, reference in pairs:
        expected = Rouge().get_scores([prediction], [reference], avg=True)["rouge-l"]["f"]
        assert rouge_l(prediction, [reference]) == pytest.approx(expected)
    # LCS (a, c, d): P = 3/4, R = 3/5
    assert rouge_l("a b c d", ["a x c y d"]) == pytest.approx(2 * 0.75 * 0.6 / 1.35, abs=1e-6)
    assert rouge_l("same words", ["same words"]) == pytest.approx(1.0, abs=1e-6)
    assert rouge_l("Same Words.", ["same words"]) == 0.0  # no normalisation, as LongBench
    assert rouge_l("", ["anything"]) == 0.0  # the package refuses an empty text: scored 0
    assert rouge_l("a b", ["x", "b a"]) == pytest.approx(0.5, abs=1e-6)  # best reference


def test_kl_divergence_known_value():
    p = torch.log(torch.tensor([0.5, 0.5]))
    q = torch.log(torch.tensor([0.9, 0.1]))
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl_divergence(p, q) == pytest.approx(expected, rel=1e-6)
    assert kl_divergence(q, q) == pytest.approx(0.0, abs=1e-12)
    assert kl_divergence(p + 3.0, q) == pytest.approx(expected, rel=1e-6)  # logits, not probabilities


def test_log_margin_is_the_top_log_probability_minus_the_runner_ups():
    probabilities = torch.tensor([0.1, 0.6, 0.25, 0.05])
    assert log_margin(probabilities.log()) == pytest.approx(math.log(0.6 / 0.25), rel=1e-6)
    assert log_margin(probabilities.log() + 3.0) == pytest.approx(math.log(0.6 / 0.25), rel=1e-6)  # logits
    assert log_margin(torch.tensor([0.5, 0.5]).log()) == 0.0


def _full_prefill(margin: float) -> torch.Tensor:
    """A first-token distribution (log-probabilities) whose top token leads the runner-up by ``margin``."""
    return torch.log_softmax(torch.tensor([-3.0, 2.0, 2.0 - margin, -1.0]), dim=-1)


@dataclass(frozen=True)
class Scored:
    """The two fields of a method record the split reads."""

    first_token_agreement: bool
    reference_margin: float | None


def test_agreement_is_split_at_the_decisive_margin():
    above, below = log_margin(_full_prefill(0.51)), log_margin(_full_prefill(0.49))
    assert above == pytest.approx(0.51, abs=1e-5) and below == pytest.approx(0.49, abs=1e-5)
    assert DECISIVE_MARGIN == 0.5 and is_decisive(above) and not is_decisive(below)
    assert is_decisive(DECISIVE_MARGIN)  # at the threshold: decisive
    records = [
        Scored(True, above),
        Scored(False, above),
        Scored(True, 4.0),
        Scored(False, below),
        Scored(True, 0.0),
        Scored(False, None),  # recorded before the margin was: left out, not guessed
    ]
    split = agreement_split(records)
    assert split == {
        "decisive_cases": 3,
        "decisive_agreeing": 2,
        "first_token_agreement_decisive": pytest.approx(2 / 3),
        "near_tie_cases": 2,
        "near_tie_agreeing": 1,
        "first_token_agreement_near_tie": 0.5,
    }
    # the threshold is a value: at 0 every case is decisive, above the largest margin none is
    assert agreement_split(records, 0.0)["decisive_cases"] == 5
    at_five = agreement_split(records, 5.0)
    assert at_five["decisive_cases"] == 0 and at_five["near_tie_cases"] == 5
    assert "first_token_agreement_decisive" not in at_five  # no share of nothing
    assert agreement_split([Scored(True, None)]) == {}


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf])
def test_a_decisive_margin_must_be_finite_and_not_negative(bad):
    with pytest.raises(ValueError, match="decisive margin"):
        check_decisive_margin(bad)
    assert check_decisive_margin(0.0) == 0.0


def test_continuation_nll_equals_full_prefill_likelihood(model):
    tok = model.tokenizer
    prompt = tok("The capital of France is", add_special_tokens=False)["input_ids"]
    answer = tok(" Paris, a city on the Seine.", add_special_tokens=False)["input_ids"]
    logits, _ = model.prefill(prompt + answer, all_logits=True)
    log_probs = torch.log_softmax(logits[0, len(prompt) - 1 : -1].float(), dim=-1)
    expected = -log_probs.gather(1, torch.tensor(answer)[:, None]).mean().item()

    next_logits, cache = model.prefill(prompt, extra_capacity=4)  # the cache must grow past its capacity
    assert continuation_nll(model, cache, len(prompt), next_logits[0], answer) == pytest.approx(
        expected, abs=1e-4
    )
    # the prompt's slots are untouched: scoring again gives the same number
    assert continuation_nll(model, cache, len(prompt), next_logits[0], answer) == pytest.approx(
        expected, abs=1e-4
    )
    assert continuation_nll(model, cache, len(prompt), next_logits[0], []) is None
