"""``CacheBlendRAG.check`` and ``cacheblend-rag check`` on a tiny real corpus: its numbers equal eval's on
the same cases, the table and --json, a questions file, sampled questions, bad input refused."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from cacheblend_rag.check import sample_questions
from cacheblend_rag.cli import app
from cacheblend_rag.corpus.corpus import Corpus
from cacheblend_rag.engine import Engine
from cacheblend_rag.eval.datasets import load_dataset
from cacheblend_rag.eval.harness import EvalConfig, evaluate_case, setup_run
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
    report = rag.check(QUESTIONS[:2], ratios=(0.15,), max_new_tokens=MAX_TOKENS, top_k=TOP_K)
    assert [r.label for r in report.rows] == ["full_recompute", "cacheblend@0.15"]
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
        methods=("full_recompute", "cacheblend"),
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
    eval_cases = [evaluate_case(run, case, run.specs) for case in load_dataset(str(data)).cases]

    for checked, evaluated in zip(report.cases, eval_cases, strict=True):
        chunks = rag.corpus.get_chunks(checked["chunk_ids"])
        assert [c.token_ids for c in chunks] == [r.token_ids for r in evaluated.retrieved]
        assert checked["prompt_tokens"] == evaluated.prompt_tokens
        for label in ("full_recompute", "cacheblend@0.15"):
            ours, theirs = checked["methods"][label], evaluated.methods[label].to_dict()
            for key in ("answer", "first_token", "first_token_agreement", "agreement_f1", "kl_first_token"):
                assert ours[key] == theirs[key], (label, key)
            assert ours["chunk_recompute_ratio"] == theirs["chunk_recompute_ratio"]
    summary = summarize({"cases": [c.to_dict() for c in eval_cases], "config": {"task": "qa"}})["methods"]
    for row in report.rows:
        entry = summary[row.label]
        assert row.first_token_agreement == entry["first_token_agreement"]
        assert row.kl_first_token == entry["kl_first_token"]
        assert row.agreement_f1 == entry["agreement_f1"]
    reference = report.row("full_recompute")
    assert reference.first_token_agreement == 1.0 and reference.kl_first_token == 0.0
    assert reference.speedup_median == 1.0
    blend = report.row("cacheblend@0.15")
    assert 0 < blend.chunk_recompute_ratio <= 0.2 and blend.compute_fraction < 1.0
    assert math.isfinite(blend.speedup_median) and blend.speedup_median > 0


def test_target_picks_the_lowest_ratio_meeting_it(rag):
    report = rag.check(QUESTIONS[:1], ratios=(1.0, 0.0), target_agreement=1.0, max_new_tokens=2, top_k=TOP_K)
    assert [r.ratio for r in report.rows] == [None, 1.0, 0.0]
    # ratio 1.0 recomputes every token: it agrees with full prefill, so the lowest is 1.0 or 0.0
    meeting = sorted(r.ratio for r in report.rows[1:] if r.first_token_agreement >= 1.0)
    assert report.row("cacheblend@1").first_token_agreement == 1.0
    assert report.lowest_ratio_meeting_target == meeting[0]


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
            *("--max-tokens", "4", "--top-k", str(TOP_K), "--target-agreement", "0.5"),
        ],
    )
    assert result.exit_code == 0, result.output
    for text in ("3 questions", "full_recompute", "cacheblend@0.15", "cacheblend@0.5", "speed-up", "KL"):
        assert text in result.output
    assert "lowest ratio meeting 0.5" in result.output


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
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["sampled"] and len(report["questions"]) == 2
    assert report["questions"] == sample_questions(Corpus.open(corpus_dir), 2)
    assert [r["label"] for r in report["rows"]] == ["full_recompute", "cacheblend@0.15"]
    assert report["lowest_ratio_meeting_target"] is None and report["target_note"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--questions", "EMPTY"], "holds no questions"),
        (["--ratios", "0.1,1.5"], "between 0 and 1"),
        (["--ratios", "a,b"], "comma-separated"),
        (["--target-agreement", "0"], "(0, 1]"),
        (["--target-agreement", "1.2"], "(0, 1]"),
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
