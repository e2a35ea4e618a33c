"""What ``cacheblend-rag bench`` runs: the sections, their sizes, and what every section shares."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ...config import DEFAULT_CHUNK_TOKENS, DEFAULT_RATIO, DEFAULT_TOP_K
from ...models.runtime import LayerwiseModel
from ...settings import get_settings
from ..datasets import load_dataset

BENCH_FORMAT = "cacheblend-rag-bench/1"
# Run by default, in this order; each can be run alone with --only.
SECTIONS = ("ttft", "prefill", "store", "deviation", "ingest", "throughput", "round", "serve")
# Run only when named with --only: they need an optional install (vllm: the [vllm] extra).
OPTIONAL_SECTIONS = ("vllm", "codec")  # run with --only
ALL_SECTIONS = SECTIONS + OPTIONAL_SECTIONS


@dataclass
class BenchConfig:
    """What the benchmark runs. :meth:`quick_config` shrinks everything to a smoke test of minutes."""

    quick: bool = False
    sections: tuple[str, ...] = SECTIONS
    repeats: int = 3
    ratio: float = DEFAULT_RATIO
    num_chunks: int = 6
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    chunk_counts: tuple[int, ...] = (3, 6, 12)
    chunk_lengths: tuple[int, ...] = (256, 512, 1024)
    prefill_tokens: int = 3072
    deviation_prompts: int = 20
    deviation_ratios: tuple[float, ...] = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3)
    top_k: int = DEFAULT_TOP_K
    throughput_requests: int = 8
    throughput_levels: tuple[int, ...] = (1, 4, 8, 16)
    throughput_max_new_tokens: int = 16
    round_max_agents: int = 16  # the round section's agents: 1, 2, 4, 8, 16 up to this many
    round_fidelity_cases: int = 20  # held-out MuSiQue rounds of 8 agents for the round's fidelity
    vllm_chunk_counts: tuple[int, ...] = (6, 12)  # the vllm section's prompt sizes (x chunk_tokens)
    vllm_agreement_prompts: int = 20  # MuSiQue prompts whose first tokens the vllm section compares
    serve_levels: tuple[int, ...] = (1, 4, 8, 16)  # concurrent clients of the serve load test
    serve_rounds: int = 2  # requests each client sends back to back
    serve_max_new_tokens: int = 16
    query_max_new_tokens: int = 16
    ingest_max_chars: int | None = None  # cut each corpus file to this many characters (quick runs)
    ingest_files: int | None = None  # use only the first N corpus files (quick runs)
    data: str = "musique"
    model: str | None = None
    kv_dir: Path | None = None  # persistent KV of the deviation/throughput prompts (default: eval's)
    work_dir: Path | None = None  # scratch stores (default: under the settings home)

    @classmethod
    def quick_config(cls, **overrides: Any) -> BenchConfig:
        """Tiny sizes that exercise every code path; its timings mean nothing."""
        base = cls(
            quick=True,
            repeats=1,
            num_chunks=3,
            chunk_tokens=64,
            chunk_counts=(2, 3),
            chunk_lengths=(32, 64),
            prefill_tokens=256,
            deviation_prompts=2,
            deviation_ratios=(0.0, 0.15),
            top_k=3,
            throughput_requests=2,
            throughput_levels=(1, 2),
            throughput_max_new_tokens=2,
            round_max_agents=2,
            round_fidelity_cases=1,
            vllm_chunk_counts=(3,),
            vllm_agreement_prompts=1,
            serve_levels=(1, 2),
            serve_rounds=1,
            serve_max_new_tokens=2,
            query_max_new_tokens=2,
            ingest_max_chars=1500,
            ingest_files=1,
        )
        return replace(base, **overrides)

    def __post_init__(self) -> None:
        unknown = [s for s in self.sections if s not in ALL_SECTIONS]
        if unknown:
            raise ValueError(
                f"unknown bench section(s) {', '.join(unknown)}; available: {', '.join(ALL_SECTIONS)}"
            )
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")


@dataclass
class BenchContext:
    """What every section shares: the model, the real text, the config, scratch space."""

    config: BenchConfig
    model: LayerwiseModel
    work_dir: Path
    question: str
    text_ids: list[int]  # real text (MuSiQue paragraphs), tokenized once, cut into chunks by the sections

    def chunk_ids(self, count: int, length: int) -> list[tuple[int, ...]]:
        needed = count * length
        if needed > len(self.text_ids):
            raise ValueError(
                f"{count} x {length} tokens exceed the {len(self.text_ids)} tokens of bench text"
            )
        return [tuple(self.text_ids[i * length : (i + 1) * length]) for i in range(count)]


def make_context(config: BenchConfig, model: LayerwiseModel) -> BenchContext:
    dataset = load_dataset(config.data)
    # one context per case: a case's contexts are overlapping windows of the same articles
    paragraphs = [case.contexts[0].text for case in dataset.cases]
    needed = max(
        max(config.chunk_counts) * config.chunk_tokens,
        config.num_chunks * max(config.chunk_lengths),
        config.prefill_tokens,
        config.num_chunks * config.chunk_tokens,
    )
    ids: list[int] = []
    for paragraph in paragraphs:  # tokenize only as much text as the largest section needs
        ids += model.tokenizer(paragraph + "\n\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= needed:
            break
    work_dir = config.work_dir or get_settings().home / "bench"
    work_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="run-", dir=work_dir))
    question = next(c.question for c in dataset.cases if c.question)
    return BenchContext(config, model, scratch, question, ids)
