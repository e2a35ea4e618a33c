"""``CacheBlendRAG.check`` and ``cacheblend-rag check`` on a tiny real corpus: its numbers equal eval's on
the same cases, the table and --json, a questions file, sampled questions, bad input refused."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from cacheblend_rag.blend import parse_method
from cacheblend_rag.check import (
    CheckReport,
    CheckRow,
    more_questions_needed,
    sample_questions,
    verdict,
    wilson_interval,
)
from cacheblend_rag.cli import app
from cacheblend_rag.config import DEFAULT_METHOD
from cacheblend_rag.corpus.corpus import Corpus
from cacheblend_rag.engine import Engine
from cacheblend_rag.engine.fidelity import MethodRecord, method_table
from cacheblend_rag.eval.datasets import load_dataset
from cacheblend_rag.eval.harness import EvalConfig, evaluate_case, setup_run
from cacheblend_rag.eval.report import split_cell
from cacheblend_rag.eval.summary import summarize
from cacheblend_rag.rag import CacheBlendRAG

pytestmark = pytest.mark.slow

# Short documents, one chunk each (well under the 128-token chunks), so eval's chunker cuts the same chunks.
TEXTS = [
    "The Amazon rainforest covers much of the Amazon basin in South America. It is home to millions of "
    "species of insects, plants, birds and other animals.",
    "Marie Curie was a physicist and chemist who conducted pioneering research on radioactivity. She was "
    "the first woman to win a Nobel Prize.",
    "The Great Wall of China is a series of fortifications built across the historical northern borders "
    "of ancient Chinese states to protect against nomadic groups.",
    "Mount Everest is the highest mountain above sea level, located in the Mahalangur Himal range of the "
    "Himalayas on the border of Nepal and China.",
]
QUESTIONS = [
    "What did Marie Curie research?",
    "Where is Mount Everest?",
    "What lives in the Amazon rainforest?",
]
CHUNK_TOKENS = 128
TOP_K = 3
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory, model_tokenizer, embedder):
    path = tmp_path_factory.mktemp("check") / "corpus"
    with Corpus.create(path, model_tokenizer, embedder, CHUNK_TOKENS) as corpus:
        ids = corpus.add_texts(TEXTS)
    assert all(len(chunks) == 1 for chunks in ids)  # one chunk per text, as eval will cut them
    return path


@pytest.fixture(scope="module")
def rag(corpus_dir, model):
    corpus = Corpus.open(corpus_dir)
    engine = Engine(model, corpus.kv_dir, chunk_context=corpus.chunk_context, kv_dtype=corpus.kv_dtype)
    rag = CacheBlendRAG(corpus, engine=engine)
    yield rag
    engine.close()


def test_check_equals_eval_on_the_same_cases(rag, model, tmp_path):
    report = rag.check(QUESTIONS[:2], ratios=(0.15,), max_tokens=MAX_TOKENS, top_k=TOP_K)
    default = parse_method(DEFAULT_METHOD).with_ratio(0.15).label  # the method setting at that ratio
    assert [r.label for r in report.rows] == ["full_recompute", default]
    assert report.questions == QUESTIONS[:2] and not report.sampled

    # the same questions as an eval data set over the same documents, through eval's own setup and runner
    items = [
        {"id": i, "question": q, "answers": ["unused"], "ctxs": [{"title": "", "text": t} for t in TEXTS]}
        for i, q in enumerate(QUESTIONS[:2])
    ]
    data = tmp_path / "cases.json"
    data.write_text(json.dumps(items))
    config = EvalConfig(
        data=str(data),
        methods=("full_recompute", default),
        ratios=(0.15,),
        top_k=TOP_K,
        chunk_tokens=CHUNK_TOKENS,
        max_new_tokens=MAX_TOKENS,
        task="qa",
        kv_dir=tmp_path / "kv",
    )
    run = setup_run(config, model)
    for engine in run.engines.values():  # check answers with the product's prompt, eval with its QA prompt
        engine.prompts = rag.engine.prompts
    cases = load_dataset(str(data)).cases
    eval_cases = [evaluate_case(run, case, run.specs) for case in cases]
    retrieved = [run.corpus.retrieve(case, TOP_K, "qa")[0] for case in cases]  # what eval answered over

    for checked, evaluated, eval_chunks in zip(report.cases, eval_cases, retrieved, strict=True):
        chunks = rag.corpus.get_chunks(checked["chunk_ids"])
        assert [c.token_ids for c in chunks] == [r.token_ids for r in eval_chunks]
        assert [len(c.token_ids) for c in chunks] == [r.tokens for r in evaluated.retrieved]
        assert checked["prompt_tokens"] == evaluated.prompt_tokens
        for label in ("full_recompute", default):
            ours, theirs = checked["methods"][label], evaluated.methods[label].to_dict()
            keys = ("answer", "first_token", "first_token_agreement", "agreement_f1", "kl_first_token")
            for key in (*keys, "reference_margin"):
                assert ours[key] == theirs[key], (label, key)
            # every method of a case carries full prefill's margin, which decides decisive vs near-tie
            assert ours["reference_margin"] == checked["methods"]["full_recompute"]["reference_margin"] > 0
            assert ours["chunk_recompute_ratio"] == theirs["chunk_recompute_ratio"]
    summary = summarize(eval_cases, "qa").methods
    for row in report.rows:
        entry = summary[row.label]
        assert row.first_token_agreement == entry.first_token_agreement
        assert row.kl_first_token == entry.kl_first_token
        assert row.agreement_f1 == entry.agreement_f1
        assert row.decisive_questions == entry.decisive_cases <= row.questions
        assert row.decisive_agreeing == entry.decisive_agreeing
        assert row.near_tie_questions == entry.near_tie_cases
        assert row.near_tie_agreeing == entry.near_tie_agreeing
        assert entry.decisive_cases + entry.near_tie_cases == row.questions
        assert row.decisive_agreeing + row.near_tie_agreeing == row.agreeing
    for row in report.rows:  # the whole answer: the same as full prefill's, counted from the cases
        same = sum(
            c["methods"][row.label]["answer"] == c["methods"]["full_recompute"]["answer"]
            for c in report.cases
        )
        assert row.answers_equal == same and row.answer_match == same / row.questions
        assert (row.answer_match_low, row.answer_match_high) == wilson_interval(same, row.questions)
        assert row.agreement_f1_low <= row.agreement_f1 <= row.agreement_f1_high
    reference = report.row("full_recompute")
    assert reference.first_token_agreement == 1.0 and reference.kl_first_token == 0.0
    assert reference.answers_equal == reference.questions and reference.agreement_f1_low > 0.3
    assert reference.speedup_median == 1.0
    blend = report.row(default)
    assert sum(blend.budgets.values()) == 2  # the default's choice for each question's chunks
    # the default recomputes 0.15 of long chunks, 0.25 of short ones (these questions' chunks are short)
    assert 0 < blend.chunk_recompute_ratio <= 0.26 and blend.compute_fraction < 1.0
    assert math.isfinite(blend.speedup_median) and blend.speedup_median > 0


def test_one_question_gives_no_verdict_but_how_many_more_are_needed(rag):
    with pytest.raises(KeyError, match="no row"):
        CheckReport([], [], False, None, None, "", 1).row("cacheblend@0.15")
    report = rag.check(QUESTIONS[:1], ratios=(1.0, 0.0), target_agreement=0.9, max_tokens=2, top_k=TOP_K)
    assert [r.ratio for r in report.rows] == [None, 1.0, 0.0]
    # the method setting at ratio 1 recomputes every token: agrees with full prefill
    full_ratio = report.row(parse_method(DEFAULT_METHOD).with_ratio(1.0).label)
    assert (full_ratio.agreeing, full_ratio.questions) == (1, 1)
    assert full_ratio.agreement_low == pytest.approx(wilson_interval(1, 1)[0])
    assert full_ratio.agreement_low < 0.9
    # one agreeing question is no evidence of 90 % agreement: no ratio is named, the count that would be is
    assert report.lowest_ratio_meeting_target is None
    assert "not enough questions" in report.target_note and report.more_questions_needed > 20


def _row(
    ratio: float,
    agreeing: int,
    questions: int,
    near_ties: int = 0,
    near_tie_agreeing: int = 0,
    f1: float = 1.0,
    equal: int | None = None,
) -> CheckRow:
    """A row of ``questions`` decisive ones (``agreeing`` agree) and ``near_ties`` more, whose answers
    have a mean F1 of ``f1`` with full prefill's and ``equal`` of them are its very answer (default: all,
    when ``f1`` is 1)."""
    total, total_agreeing = questions + near_ties, agreeing + near_tie_agreeing
    low, high = wilson_interval(total_agreeing, total)
    decisive_low, decisive_high = wilson_interval(agreeing, questions)
    equal = total if equal is None and f1 == 1.0 else equal or 0
    return CheckRow(
        f"cacheblend@{ratio:g}", ratio, total_agreeing / total, 0.0, f1, 1.0, 2.0, ratio, ratio,
        total, total_agreeing, low, high, questions, agreeing, decisive_low, decisive_high,
        near_ties, near_tie_agreeing, equal, equal / total, *wilson_interval(equal, total),
        *wilson_interval(f1 * total, total),
    )  # fmt: skip


def test_wilson_interval_matches_the_textbook_values():
    assert wilson_interval(20, 20) == pytest.approx((0.8389, 1.0), abs=1e-4)
    assert wilson_interval(19, 20) == pytest.approx((0.7639, 0.9911), abs=1e-4)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)


def test_the_verdict_does_not_flip_with_one_question_more_or_less():
    # 19 of 20 agree (0.95): the old rule (the mean >= the target) said yes; one disagreement more said no
    for agreeing, questions in ((19, 20), (19, 21), (20, 20), (20, 21)):
        lowest, note, needed = verdict([_row(0.15, agreeing, questions)], 0.9)
        assert lowest is None and "not enough questions" in note and needed > 0, (agreeing, questions)
    lowest, note, needed = verdict([_row(0.15, 200, 200)], 0.95)
    assert lowest == 0.15 and needed is None and "200/200" in note
    # below the target for sure: no ratio, and advice to go higher
    lowest, note, _ = verdict([_row(0.05, 5, 100)], 0.9)
    assert lowest is None and "try higher ratios" in note


def test_the_verdict_reads_decisive_questions_and_leaves_near_ties_out():
    # 150 decisive questions all agree, 25 of 50 near-ties do not: 175/200 overall (95% CI 0.82-0.91)
    # would hold the ratio off 0.95, but a near-tie picked the other way is no fault of the method
    row = _row(0.15, 150, 150, near_ties=50, near_tie_agreeing=25)
    assert row.agreement_high < 0.95 <= row.decisive_low
    lowest, note, needed = verdict([row], 0.95)
    assert lowest == 0.15 and needed is None and "150/150 decisive" in note
    # a decisive miss still counts
    lowest, note, _ = verdict([_row(0.15, 10, 150, near_ties=50, near_tie_agreeing=50)], 0.95)
    assert lowest is None and "try higher ratios" in note and "10/150 decisive" in note
    # only near-ties so far: no verdict, and no count of questions it cannot estimate
    lowest, note, needed = verdict([_row(0.15, 0, 0, near_ties=5, near_tie_agreeing=5)], 0.9)
    assert lowest is None and needed is None and "no decisive question yet" in note


def test_agreeing_first_tokens_with_other_answers_get_no_verdict():
    # measured on 10 questions over 118-token chunks: every first token agreed (all decisive), but only 4
    # whole answers equalled full prefill's and their mean F1 was 0.701; the first tokens alone clear 0.7
    row = _row(0.15, 10, 10, f1=0.701, equal=4)
    assert row.decisive_low >= 0.7 > row.agreement_f1_low
    lowest, note, _ = verdict([row], 0.7)
    assert lowest is None and "not enough questions" in note
    assert "answer F1 0.70, 95% CI 0.40-0.89" in note and "4/10 answers the same" in note
    # so many questions that the first tokens surely clear 0.95: the answers still hold the verdict back
    row = _row(0.15, 400, 400, f1=0.701, equal=160)
    assert row.decisive_low >= 0.95 > row.agreement_f1_high
    lowest, note, _ = verdict([row], 0.95)
    assert lowest is None and "try higher ratios" in note and "400/400 decisive" in note
    # the same first tokens with the answers full prefill's: the verdict names the ratio
    lowest, note, _ = verdict([_row(0.15, 400, 400)], 0.95)
    assert lowest == 0.15 and "both whole intervals" in note and "400/400 answers the same" in note
    # answers whose interval straddles the target: more questions would tell, counted for the answers
    row = _row(0.15, 400, 400, f1=0.97, equal=380)
    assert row.agreement_f1_low < 0.95 <= row.agreement_f1_high
    lowest, note, needed = verdict([row], 0.95)
    assert lowest is None and "not enough questions" in note
    assert needed == more_questions_needed(0.97 * 400, 400, 0.95)


def test_more_questions_are_counted_over_all_questions_not_just_decisive_ones():
    # half the questions are decisive: settling 10/10 decisive takes twice the decisive ones needed
    row = _row(0.15, 10, 10, near_ties=10, near_tie_agreeing=0)
    _, _, needed = verdict([row], 0.95)
    assert needed == 2 * more_questions_needed(10, 10, 0.95)


def test_how_many_more_questions_brings_the_interval_over_the_target():
    needed = more_questions_needed(20, 20, 0.95)
    assert wilson_interval(20 + needed, 20 + needed)[0] >= 0.95
    assert wilson_interval(20 + needed - 1, 20 + needed - 1)[0] < 0.95


def test_ties_go_to_the_cheaper_ratio():
    rows = [_row(0.3, 150, 150), _row(0.05, 150, 150), _row(0.15, 150, 150)]
    assert verdict(rows, 0.95)[0] == 0.05
    failing = [_row(0.3, 10, 100), _row(0.05, 10, 100), _row(0.15, 10, 100)]
    assert "best: cacheblend@0.05" in verdict(failing, 0.95)[1]
    # a dearer ratio that surely meets the target is named; the cheaper undecided one is reported too
    lowest, note, needed = verdict([_row(0.05, 30, 30), _row(0.3, 200, 200)], 0.95)
    assert lowest == 0.3 and "cacheblend@0.05" in note and needed > 0


def test_sampled_questions_are_distinct_chunk_derived_and_deterministic(corpus_dir):
    corpus = Corpus.open(corpus_dir)
    picked = sample_questions(corpus, 3)
    assert picked == sample_questions(corpus, 3)
    assert len(set(picked)) == 3
    for question in picked:
        words = question.removeprefix("What does the text say about ").removesuffix("?")
        assert words and any(text.startswith(words) for text in TEXTS)
    assert len(sample_questions(corpus, 10)) == len(TEXTS)  # never more than the corpus's chunks


def test_cli_prints_the_table_for_a_questions_file(corpus_dir, tmp_path):
    questions = tmp_path / "questions.txt"
    questions.write_text("\n".join(QUESTIONS) + "\n\n")
    result = CliRunner().invoke(
        app,
        [
            *("check", "--corpus", str(corpus_dir), "--questions", str(questions), "--ratios", "0.15,0.5"),
            *("--method", "cacheblend"),
            *("--max-tokens", "4", "--top-k", str(TOP_K), "--target-agreement", "0.5"),
        ],
    )
    assert result.exit_code == 0, result.output
    for text in ("3 questions", "full_recompute", "cacheblend@0.15", "cacheblend@0.5", "speed-up", "KL"):
        assert text in result.output
    assert "3/3" in result.output  # the counts behind the agreement
    words = " ".join(result.output.split())
    assert "full prefill's first token leads its runner-up by >= 0.5 nats" in words
    for column in ("decisive", "near-tie"):
        assert column in result.output
    # per method: decisive k/n and near-tie k/n, their n summing to the 3 questions
    for label in ("full_recompute", "cacheblend@0.15", "cacheblend@0.5"):
        line = next(line for line in result.output.splitlines() if line.split()[:1] == [label])
        counts = [cell for cell in line.split() if "/" in cell]
        assert len(counts) == 3 and counts[0].endswith("/3"), line  # all, decisive, near-tie
        assert int(counts[1].split("/")[1]) + int(counts[2].split("/")[1]) == 3, line
    assert "verdict" in words


def test_cli_table_reads_at_80_columns(corpus_dir, tmp_path):
    questions = tmp_path / "questions.txt"
    questions.write_text("\n".join(QUESTIONS[:2]) + "\n")
    command = ["check", "--corpus", str(corpus_dir), "--questions", str(questions), "--ratios", "0.15"]
    command += ["--method", "cacheblend", "--max-tokens", "2", "--top-k", str(TOP_K)]
    command += ["--target-agreement", "0.9"]
    result = CliRunner().invoke(app, command, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    agreement, answers, fidelity = (line for line in lines if line.split()[:1] == ["method"])
    for column in ("agree", "95% CI", "decisive", "near-tie"):
        assert column in agreement  # whole, on one line
    for column in ("same answer", "95% CI", "F1"):
        assert column in answers
    for column in ("KL", "TTFT ms", "speed-up", "recomp."):
        assert column in fidelity
    assert any("cacheblend@0.15" in line and "/2" in line for line in lines)
    assert "more needed to tell" in " ".join(result.stdout.split())


def test_cli_on_the_sample_corpus_prints_answer_agreement_with_counts_and_intervals(rag_store):
    command = ["check", "--corpus", str(rag_store), "--sample", "2", "--max-tokens", "6", "--top-k", "2"]
    command += ["--ratios", "0.15", "--target-agreement", "0.9"]
    result = CliRunner().invoke(app, command, env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if "same answer" in line)
    rows = {}
    for line in lines[header + 1 :]:
        cells = line.split()
        if len(cells) == 5 and "/" in cells[1]:  # method, k/n, interval, F1, interval
            rows[cells[0]] = cells[1:]
        elif rows:
            break
    default = parse_method(DEFAULT_METHOD).with_ratio(0.15).label
    assert set(rows) == {"full_recompute", default}, result.stdout
    for label, (count, count_ci, f1, f1_ci) in rows.items():
        equal, questions = map(int, count.split("/"))
        assert questions == 2 and 0 <= equal <= 2
        assert count_ci == "{:.2f}-{:.2f}".format(*wilson_interval(equal, questions)), label
        assert f1_ci == "{:.2f}-{:.2f}".format(*wilson_interval(float(f1) * questions, questions)), label
        if equal == questions:  # every answer full prefill's very tokens: F1 1 with it
            assert float(f1) == 1.0, label
    assert rows["full_recompute"][:1] == ["2/2"]
    words = " ".join(result.stdout.split())
    assert "same answer: questions whose whole answer is full prefill's" in words
    # two questions are too few to clear 0.9: no verdict names a ratio, and the note reads the answers
    assert "no verdict" in words and "answers the same" in words


def test_cli_json_with_sampled_questions(corpus_dir):
    result = CliRunner().invoke(
        app,
        [
            "check",
            "--corpus",
            str(corpus_dir),
            "--sample",
            "2",
            "--max-tokens",
            "2",
            "--json",
            "--top-k",
            "2",
            "--decisive-margin",
            "0",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["sampled"] and len(report["questions"]) == 2
    assert report["decisive_margin"] == 0.0
    for row in report["rows"]:  # at a margin of 0 every question is decisive
        assert (row["decisive_questions"], row["near_tie_questions"]) == (2, 0)
        assert row["decisive_agreeing"] == row["agreeing"]
    assert report["questions"] == sample_questions(Corpus.open(corpus_dir), 2)
    default = parse_method(DEFAULT_METHOD).with_ratio(0.15).label  # the method setting
    assert [r["label"] for r in report["rows"]] == ["full_recompute", default]
    assert sum(report["rows"][1]["budgets"].values()) == 2 and report["rows"][0]["budgets"] == {}
    assert report["lowest_ratio_meeting_target"] is None and report["target_note"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--questions", "EMPTY"], "holds no questions"),
        (["--ratios", "0.1,1.5"], "between 0 and 1"),
        (["--ratios", "a,b"], "comma-separated"),
        (["--target-agreement", "0"], "(0, 1]"),
        (["--target-agreement", "1.2"], "(0, 1]"),
        (["--decisive-margin", "-1"], "decisive margin"),
    ],
)
def test_cli_refuses_bad_input_before_loading(tmp_path, arguments, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    arguments = [str(empty) if a == "EMPTY" else a for a in arguments]
    # the corpus does not exist: the options are refused first, so the error names them, not the corpus
    # wide enough that Rich's error panel does not wrap the message (the tmp path's length varies)
    command = ["check", "--corpus", str(tmp_path / "missing"), *arguments]
    result = CliRunner().invoke(app, command, env={"COLUMNS": "400"})
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_api_refuses_bad_input(rag):
    with pytest.raises(ValueError, match="between 0 and 1"):
        rag.check(QUESTIONS[:1], ratios=(-0.1,))
    with pytest.raises(ValueError, match="non-empty"):
        rag.check(["  "])
    with pytest.raises(ValueError, match="no questions"):
        rag.check([])
    with pytest.raises(ValueError, match="reference"):
        rag.check(QUESTIONS[:1], method="full_recompute")


def scored(agree: bool, margin: float | None) -> MethodRecord:
    """A record holding what the split reads (the rest placeholders)."""
    return MethodRecord(
        answer="",
        answer_tokens=[],
        finish_reason="length",
        ttft_s=1.0,
        segments_s=0.0,
        load_wait_s=0.0,
        total_s=1.0,
        recompute_ratio=0.0,
        reused_tokens=0,
        computed_tokens=0,
        first_token=0,
        agreement_f1=1.0,
        first_token_agreement=agree,
        kl_first_token=0.0,
        reference_margin=margin,
    )


def test_agreement_is_split_into_decisive_cases_and_near_ties():
    def case(margin, agree):
        return {"full_recompute": scored(True, margin), "m": scored(agree, margin)}

    cases = [case(2.0, True), case(0.9, False), case(0.5, True), case(0.1, False), case(0.49, True)]
    entry = method_table(cases, ["full_recompute", "m"])["m"]
    assert (entry.decisive_cases, entry.decisive_agreeing) == (3, 2)
    assert (entry.near_tie_cases, entry.near_tie_agreeing) == (2, 1)
    assert entry.first_token_agreement_decisive == pytest.approx(2 / 3)
    assert entry.first_token_agreement_near_tie == 0.5
    assert entry.first_token_agreement == pytest.approx(3 / 5)
    # results recorded before the split carry no margin: no split, not a zero
    old = method_table([{"m": scored(True, None)}], ["m"])["m"]
    assert old.decisive_cases is None and "decisive_cases" not in old.to_dict()
    assert split_cell(None, None) == "-"
    assert split_cell(entry.first_token_agreement_decisive, entry.decisive_cases) == "0.67 (3)"
