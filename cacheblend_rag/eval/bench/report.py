"""The bench section of BENCHMARKS.md: the page frame (a header per section: command, duration, machine,
load) around each section's own renderer, which lives beside its runner and reads its typed results."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...records import OpenRecord
from .codec import CodecResult, render_codec
from .config import ALL_SECTIONS
from .deviation import DeviationResult, render_deviation
from .ingest import IngestResult, render_ingest
from .page import Page
from .prefill import PrefillResult, render_prefill
from .round import RoundResult, render_round
from .serve import ServeResult, render_serve
from .store import StoreResult, render_store
from .throughput import ThroughputResult, render_throughput
from .ttft import TtftResult, render_ttft
from .vllm import VllmResult, render_vllm

__all__ = ["RENDERERS", "Page", "SectionRenderer", "render_bench"]


@dataclass(frozen=True)
class SectionRenderer:
    """A section's title, the record its results are read into, and its renderer."""

    title: str
    result: type[OpenRecord]
    render: Callable[[Page, Any], list[str]]

    def __call__(self, page: Page, name: str) -> list[str]:
        section = self.result.from_dict(page.results["sections"][name])
        return page.header(self.title, name) + self.render(page, section)


RENDERERS: dict[str, SectionRenderer] = {
    "ttft": SectionRenderer("Time to first token", TtftResult, render_ttft),
    "prefill": SectionRenderer("Full prefill: ours vs transformers", PrefillResult, render_prefill),
    "store": SectionRenderer("KV store: loading and storage", StoreResult, render_store),
    "deviation": SectionRenderer("Attention deviation vs recompute ratio", DeviationResult, render_deviation),
    "ingest": SectionRenderer("Ingest and query on the sample corpus", IngestResult, render_ingest),
    "throughput": SectionRenderer("Throughput: concurrent requests", ThroughputResult, render_throughput),
    "round": SectionRenderer("Rounds: N agents over the same chunks", RoundResult, render_round),
    "serve": SectionRenderer(
        "Serving: concurrent clients through `cacheblend-rag serve`", ServeResult, render_serve
    ),
    "vllm": SectionRenderer("vLLM backend: full prefill vs CacheBlend inside vLLM", VllmResult, render_vllm),
    "codec": SectionRenderer("Chunk KV codecs: bytes, TTFT, ingest, remote reads", CodecResult, render_codec),
}


def render_bench(results: dict[str, Any], markdown: Path, plots: dict[str, Path]) -> str:
    """The whole bench section: every section the results hold, in the order of :data:`ALL_SECTIONS`."""
    quick = (
        " (quick smoke run: sizes too small for the numbers to mean anything)"
        if results["config"].get("quick")
        else ""
    )
    parts = [
        f"## `cacheblend-rag bench`{quick}",
        "",
        f"Model {results['model']['name']} ({results['model']['dtype']}).",
    ]
    page = Page(results, markdown, plots)
    for name in ALL_SECTIONS:
        if name in results["sections"]:
            parts += RENDERERS[name](page, name)
    return "\n".join(parts)
