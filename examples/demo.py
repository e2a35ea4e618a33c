"""`make demo`: ingest the sample corpus (once), answer its questions with full prefill and with CacheBlend,
and print a table of answers, TTFTs and the speed-up.

The corpus lives under the cache dir (``CACHEBLEND_HOME``), so later runs skip ingestion and KV precompute.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cacheblend_rag import CacheBlendRAG, Engine, SamplingParams, get_settings
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

    table = Table(title="CacheBlend vs full prefill (top-6 chunks, greedy)", show_lines=True)
    for column in (
        "question",
        "gold",
        "full prefill answer",
        "CacheBlend answer",
        "TTFT full",
        "TTFT blend",
        "speed-up",
    ):
        table.add_column(column, overflow="fold")
    speedups = []
    for item in questions:
        full, blend = (rag.query(item["question"], method=m, sampling=sampling) for m in METHODS)
        speedups.append(full.ttft_s / blend.ttft_s)
        table.add_row(
            item["question"],
            ", ".join(item["answers"]),
            full.answer,
            blend.answer,
            f"{full.ttft_s * 1000:.0f} ms",
            f"{blend.ttft_s * 1000:.0f} ms ({blend.reused_tokens}/{blend.prompt_tokens} reused)",
            f"{speedups[-1]:.1f}x",
        )
    console.print(table)
    console.print(f"median TTFT speed-up: [bold]{statistics.median(speedups):.1f}x[/bold]")


if __name__ == "__main__":
    main()
