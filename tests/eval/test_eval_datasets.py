"""Bundled data sets, seeded case selection and bad data files."""

from __future__ import annotations

import gzip
import json

import pytest

from cacheblend_rag.errors import EvalDataError
from cacheblend_rag.eval.datasets import load_dataset, select_cases


def test_bundled_data_sets_load_with_their_tasks():
    musique = load_dataset("musique")
    assert len(musique.cases) == 60 and musique.task == "qa"
    assert all(c.question and c.answers and len(c.contexts) == 10 for c in musique.cases)
    news = load_dataset("multinews")
    assert len(news.cases) == 30 and news.task == "summary"
    assert all(not c.question and c.answers[0] for c in news.cases)
    # ids are the cases' indices in the original files
    assert musique.cases[0].case_id == 4 and len({c.case_id for c in musique.cases}) == 60


def test_selection_is_seeded_and_nested():
    cases = load_dataset("musique").cases
    ten, twenty = select_cases(cases, 10, seed=0), select_cases(cases, 20, seed=0)
    assert {c.case_id for c in ten} < {c.case_id for c in twenty}
    assert [c.case_id for c in ten] == sorted(c.case_id for c in ten)
    assert {c.case_id for c in select_cases(cases, 10, seed=1)} != {c.case_id for c in ten}
    assert len(select_cases(cases, None, seed=0)) == len(select_cases(cases, 1000, seed=0)) == 60
    with pytest.raises(ValueError, match="limit"):
        select_cases(cases, 0, seed=0)


def test_bundled_subset_is_what_the_seed_selects(tmp_path):
    """A file holding more cases selects the bundled subset's cases for --limit 60 --seed 0."""
    bundled = load_dataset("musique")
    raw = json.loads(gzip.decompress(bundled.path.read_bytes()))
    padded = raw + [{**raw[0], "id": i} for i in range(150) if i not in {c["id"] for c in raw}]
    path = tmp_path / "padded.json"
    path.write_text(json.dumps(padded))
    chosen = select_cases(load_dataset(path).cases, 60, seed=0)
    assert [c.case_id for c in chosen] == [c.case_id for c in bundled.cases]


def test_the_development_news_cases_are_the_next_of_the_seeded_order(tmp_path):
    """``multinews-dev`` holds the 30 cases after the held-out 30 in the seeded order of the full file (here
    the union of the two bundled subsets stands for it): disjoint from them, chosen by --skip 30."""
    held, dev = load_dataset("multinews"), load_dataset("multinews-dev")
    assert len(dev.cases) == 30 and dev.task == "summary"
    assert not {c.case_id for c in held.cases} & {c.case_id for c in dev.cases}
    both = [json.loads(gzip.decompress(d.path.read_bytes())) for d in (held, dev)]
    path = tmp_path / "both.json"
    path.write_text(json.dumps(both[0] + both[1]))
    cases = load_dataset(path).cases
    assert [c.case_id for c in select_cases(cases, 30, seed=0)] == [c.case_id for c in held.cases]
    assert [c.case_id for c in select_cases(cases, 30, seed=0, skip=30)] == [c.case_id for c in dev.cases]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not a \\(gzipped\\) JSON"),
        ("[]", "non-empty JSON list"),
        ('[{"question": "q", "ctxs": [{"title": "", "text": "t"}]}]', "'answers'"),
        ('[{"question": "q", "answers": ["a"], "ctxs": []}]', "'ctxs'"),
        ('[{"question": "q", "answers": ["a"], "ctxs": [{"title": "t"}]}]', "ctxs\\[0\\]"),
        ('[{"question": "q", "answers": ["a"], "ctxs": [{"text": "  "}]}]', "every context is empty"),
        (
            json.dumps([{"id": 1, "answers": ["a"], "ctxs": [{"text": t}]} for t in "xy"]),
            "twice",
        ),
    ],
)
def test_bad_data_files_are_refused_with_the_problem_named(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(EvalDataError, match=message):
        load_dataset(path)


def test_unknown_data_set_name():
    with pytest.raises(EvalDataError, match="musique"):
        load_dataset("no-such-data")


def test_heldout_set_is_what_skip_60_selects_and_never_overlaps_the_dev_split():
    dev, held = load_dataset("musique"), load_dataset("musique-heldout")
    dev_ids, held_ids = {c.case_id for c in dev.cases}, {c.case_id for c in held.cases}
    assert len(dev_ids) == 60 and len(held_ids) == 90 and not dev_ids & held_ids
    union = tuple(sorted(dev.cases + held.cases, key=lambda c: c.case_id))
    assert {c.case_id for c in select_cases(union, None, 0, skip=60)} == held_ids
    assert {c.case_id for c in select_cases(union, 60, 0)} == dev_ids


def test_musique_contexts_are_overlapping_windows_not_paragraphs():
    """What data/README.md says of the MuSiQue files (and why they give no paragraph set): every held-out
    case's contexts are untitled windows far longer than a ~100-token paragraph, and one of them begins
    inside another, so paragraph ends cannot be read off the contexts."""
    for case in load_dataset("musique-heldout").cases:
        texts = [c.text for c in case.contexts]
        assert len(texts) == 10 and all(len(t) > 1500 for t in texts)
        assert not any(c.title for c in case.contexts)
        assert any(b[:80] in a for i, a in enumerate(texts) for j, b in enumerate(texts) if i != j)
