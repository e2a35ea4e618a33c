"""`make demo`: ingest the sample corpus (once), answer its questions with full prefill and with CacheBlend,
and print a table of TTFTs, the speed-up and whether each answer is right (it holds the gold answer) and
CacheBlend's equals full prefill's, then the answers (readable in an 80-column terminal).

The questions (data/demo_questions.json) are single-hop ones the default 135M model answers right with
full prefill, so the table shows whether CacheBlend kept the answer; data/questions.json holds the
multi-hop MuSiQue questions of the same corpus, beyond a model this small.

The corpus lives under the cache dir (``CACHEBLEND_HOME``), so later runs skip ingestion and KV precompute.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cacheblend_rag import CacheBlendRAG, Engine, QueryResult, SamplingParams, get_settings
from cacheblend_rag.ingest import ingest

DATA = Path(__file__).parent / "data"
METHODS = ("full_recompute", "cacheblend")


def main() -> None:
    console = Console()
    settings = get_settings()  # read here, in the application, and passed down
    corpus = settings.home / "stores" / "sample"
    console.print(f"[bold]Ingesting[/bold] {DATA / 'corpus'} into {corpus} (unchanged files are skipped)…")
    engine = Engine(store=corpus / "kv", config=settings)
    summary = ingest([DATA / "corpus"], corpus, engine=engine, config=settings)
    console.print(
        f"  {summary.files} files, {summary.chunks} chunks ({summary.new_chunks} new), "
        f"{summary.kv_bytes / 1e6:.1f} MB of KV written, {summary.seconds:.1f} s"
    )
    rag = CacheBlendRAG(corpus, engine=engine)
    questions = json.loads((DATA / "demo_questions.json").read_text())
    sampling = SamplingParams(max_tokens=32)
    rag.query(questions[0]["question"], method="cacheblend", sampling=SamplingParams(max_tokens=1))  # warm-up

    results = []
    for item in questions:
        full, blend = (rag.query(item["question"], method=m, sampling=sampling) for m in METHODS)
        results.append((item, full, blend))
    render(console, results)


def _words(text: str) -> str:
    return " " + " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split()) + " "


def matches(answer: str, gold: list[str]) -> bool:
    """Whether ``answer`` holds one of the ``gold`` answers as whole words (case and punctuation aside)."""
    return any(_words(g) in _words(answer) for g in gold)


def yes(flag: bool) -> str:
    return "yes" if flag else "no"


def render(console: Console, results: list[tuple[dict, QueryResult, QueryResult]]) -> None:
    """The table (TTFTs, speed-up, reused tokens, whether each answer is right and whether CacheBlend's
    equals full prefill's; short cells, so it fits an 80-column terminal), then each question with the
    gold answer and both answers as wrapped lines."""
    table = Table(
        title="CacheBlend (CB) vs full prefill (top-6 chunks, greedy)",
        caption="ok: the answer holds the gold one; CB=full: CacheBlend's answer is full prefill's",
    )
    for column in ("#", "TTFT full", "TTFT CB", "speed", "reused", "full ok", "CB ok", "CB=full"):
        table.add_column(column, justify="right", no_wrap=True)
    speedups = []
    right = {"full": 0, "blend": 0, "same": 0}
    for number, (item, full, blend) in enumerate(results, start=1):
        speedups.append(full.ttft_s / blend.ttft_s)
        checks = {
            "full": matches(full.answer, item["answers"]),
            "blend": matches(blend.answer, item["answers"]),
            "same": blend.answer == full.answer,
        }
        for key, flag in checks.items():
            right[key] += flag
        table.add_row(
            str(number),
            f"{full.ttft_s * 1000:,.0f} ms",
            f"{blend.ttft_s * 1000:,.0f} ms",
            f"{speedups[-1]:.1f}x",
            f"{blend.reused_tokens:,}/{blend.prompt_tokens:,}",
            yes(checks["full"]),
            yes(checks["blend"]),
            yes(checks["same"]),
        )
    console.print(table)
    for number, (item, full, blend) in enumerate(results, start=1):
        gold = escape(", ".join(item["answers"]))
        console.print(f"\n[bold]{number}. {escape(item['question'])}[/bold]  (gold: {gold})")
        console.print(f"   full prefill: {escape(full.answer)}")
        console.print(f"   CacheBlend:   {escape(blend.answer)}")
    n = len(results)
    console.print(
        f"\nright: full prefill {right['full']}/{n}, CacheBlend {right['blend']}/{n}; CacheBlend's answer "
        f"equals full prefill's on {right['same']}/{n}"
    )
    console.print(f"median TTFT speed-up: [bold]{statistics.median(speedups):.1f}x[/bold]")


if __name__ == "__main__":
    main()
