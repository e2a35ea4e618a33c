"""`make demo`: ingest the sample corpus (once), answer its questions with full prefill and with CacheBlend,
and print a table of TTFTs and the speed-up, then the answers (readable in an 80-column terminal).

The corpus lives under the cache dir (``CACHEBLEND_HOME``), so later runs skip ingestion and KV precompute.
"""

from __future__ import annotations

import json
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
    corpus = get_settings().home / "stores" / "sample"
    console.print(f"[bold]Ingesting[/bold] {DATA / 'corpus'} into {corpus} (unchanged files are skipped)…")
    engine = Engine(store=corpus / "kv")
    summary = ingest([DATA / "corpus"], corpus, engine=engine)
    console.print(
        f"  {summary.files} files, {summary.chunks} chunks ({summary.new_chunks} new), "
        f"{summary.kv_bytes / 1e6:.1f} MB of KV written, {summary.seconds:.1f} s"
    )
    rag = CacheBlendRAG(corpus, engine=engine)
    questions = json.loads((DATA / "questions.json").read_text())
    sampling = SamplingParams(max_new_tokens=32)
    rag.query(
        questions[0]["question"], method="cacheblend", sampling=SamplingParams(max_new_tokens=1)
    )  # warm-up

    results = []
    for item in questions:
        full, blend = (rag.query(item["question"], method=m, sampling=sampling) for m in METHODS)
        results.append((item, full, blend))
    render(console, results)


def render(console: Console, results: list[tuple[dict, QueryResult, QueryResult]]) -> None:
    """The TTFT table (numbers only, so it fits an 80-column terminal), then each question with the gold
    answer and both answers as wrapped lines."""
    table = Table(title="CacheBlend vs full prefill (top-6 chunks, greedy)")
    for column in ("#", "TTFT full", "TTFT CacheBlend", "speed-up", "reused tokens"):
        table.add_column(column, justify="right", no_wrap=True)
    speedups = []
    for number, (_, full, blend) in enumerate(results, start=1):
        speedups.append(full.ttft_s / blend.ttft_s)
        table.add_row(
            str(number),
            f"{full.ttft_s * 1000:,.0f} ms",
            f"{blend.ttft_s * 1000:,.0f} ms",
            f"{speedups[-1]:.1f}x",
            f"{blend.reused_tokens:,}/{blend.prompt_tokens:,}",
        )
    console.print(table)
    for number, (item, full, blend) in enumerate(results, start=1):
        gold = escape(", ".join(item["answers"]))
        console.print(f"\n[bold]{number}. {escape(item['question'])}[/bold]  (gold: {gold})")
        console.print(f"   full prefill: {escape(full.answer)}")
        console.print(f"   CacheBlend:   {escape(blend.answer)}")
    console.print(f"\nmedian TTFT speed-up: [bold]{statistics.median(speedups):.1f}x[/bold]")


if __name__ == "__main__":
    main()
