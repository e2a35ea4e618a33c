"""`make demo`'s output is readable in an 80-column terminal: rendered from real answers, no line is
wider than 80 columns and no question, gold answer or answer is cut mid-word."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from rich.console import Console

from cacheblend_rag import CacheBlendRAG, SamplingParams

pytestmark = pytest.mark.slow

DEMO = Path(__file__).parents[2] / "examples" / "demo.py"


def load_demo():
    spec = importlib.util.spec_from_file_location("demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_output_fits_80_columns(rag_store, sample_questions):
    demo = load_demo()
    rag = CacheBlendRAG(rag_store)
    sampling = SamplingParams(max_tokens=12)
    results = [
        (item, *(rag.query(item["question"], top_k=2, method=m, sampling=sampling) for m in demo.METHODS))
        for item in sample_questions[:2]
    ]
    console = Console(width=80, record=True, force_terminal=False)
    demo.render(console, results)
    rag.close()
    text = console.export_text()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    flat = " ".join(" ".join(lines).split())  # the wrapped text as one line: words are never split
    for item, full, blend in results:
        assert item["question"] in flat and ", ".join(item["answers"]) in flat
        assert " ".join(full.answer.split()) in flat and " ".join(blend.answer.split()) in flat
    for number, (_, full, blend) in enumerate(results, start=1):
        row = next(
            line for line in lines if line.strip().startswith(f"│ {number}") or f"│ {number} │" in line
        )
        assert (
            f"{full.ttft_s * 1000:,.0f} ms" in row
            and f"{blend.reused_tokens:,}/{blend.prompt_tokens:,}" in row
        )
        item = results[number - 1][0]
        cells = [c.strip() for c in row.split("│")[-4:-1]]  # full ok, CB ok, CB=full
        assert cells == [
            demo.yes(demo.matches(full.answer, item["answers"])),
            demo.yes(demo.matches(blend.answer, item["answers"])),
            demo.yes(blend.answer == full.answer),
        ], row


def test_matching_a_gold_answer_takes_whole_words():
    demo = load_demo()
    assert demo.matches("The writer was born in Paris, France.", ["Paris"])
    assert demo.matches("by george packer is a book", ["George Packer"])
    assert not demo.matches("born in Parisville", ["Paris"])
    assert not demo.matches("established in 20021", ["2002"])


def test_the_default_model_answers_most_demo_questions_right_with_full_prefill(rag_store):
    """The demo's questions are ones full prefill answers right: at least 3."""
    demo = load_demo()
    questions = json.loads((DEMO.parent / "data" / "demo_questions.json").read_text())
    rag = CacheBlendRAG(rag_store)
    sampling = SamplingParams(max_tokens=32)
    answers = [rag.query(q["question"], method="full_recompute", sampling=sampling).answer for q in questions]
    rag.close()
    right = [demo.matches(a, q["answers"]) for a, q in zip(answers, questions, strict=True)]
    assert sum(right) >= 3, list(zip(answers, right, strict=True))
