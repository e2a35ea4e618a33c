"""Evaluation and benchmarks: ``cacheblend-rag eval`` (quality and fidelity of each method on real data),
``cacheblend-rag bench`` (:mod:`.bench`: TTFT and the other timings, side by side), with their
BENCHMARKS.md sections and plots, and the accelerator check (:mod:`.gpu`, which runs where only torch and
numpy are installed).

The public names load on first use, so that ``python -m cacheblend_rag.eval.gpu`` imports none of the
evaluation's libraries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..lazy import load_export

_EXPORTS = {
    "BenchConfig": "bench",
    "run_bench": "bench",
    "Dataset": "datasets",
    "EvalCase": "datasets",
    "load_dataset": "datasets",
    "select_cases": "datasets",
    "EvalConfig": "harness",
    "run_eval": "harness",
    "update_markdown": "markdown",
    "continuation_nll": "metrics",
    "kl_divergence": "metrics",
    "qa_f1": "metrics",
    "rouge_l": "metrics",
    "EvalResults": "records",
    "load_results": "records",
    "summarize": "summary",
    "Variant": "variants",
    "method_specs": "variants",
    "method_variants": "variants",
    "parse_variant": "variants",
}

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

if TYPE_CHECKING:
    from .bench import BenchConfig, run_bench
    from .datasets import Dataset, EvalCase, load_dataset, select_cases
    from .harness import EvalConfig, run_eval
    from .markdown import update_markdown
    from .metrics import continuation_nll, kl_divergence, qa_f1, rouge_l
    from .records import EvalResults, load_results
    from .summary import summarize
    from .variants import Variant, method_specs, method_variants, parse_variant


def __getattr__(name: str) -> Any:
    return load_export(__name__, _EXPORTS, name, globals())


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
