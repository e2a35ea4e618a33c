"""Evaluation and benchmarks: ``cacheblend-rag eval`` (quality and fidelity of each method on real data)
and ``cacheblend-rag bench`` (:mod:`.bench`: TTFT and the other timings, side by side), with their
BENCHMARKS.md sections and plots."""

from .bench import BenchConfig, run_bench
from .datasets import Dataset, EvalCase, load_dataset, select_cases
from .harness import EvalConfig, run_eval
from .markdown import update_markdown
from .metrics import continuation_nll, kl_divergence, qa_f1, rouge_l
from .records import EvalResults, load_results
from .summary import summarize
from .variants import Variant, method_specs, method_variants, parse_variant

__all__ = [
    "BenchConfig",
    "Dataset",
    "EvalCase",
    "EvalConfig",
    "EvalResults",
    "Variant",
    "continuation_nll",
    "kl_divergence",
    "load_dataset",
    "load_results",
    "method_specs",
    "method_variants",
    "parse_variant",
    "qa_f1",
    "rouge_l",
    "run_bench",
    "run_eval",
    "select_cases",
    "summarize",
    "update_markdown",
]
