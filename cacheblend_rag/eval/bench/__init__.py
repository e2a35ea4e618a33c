"""The benchmark suite behind ``cacheblend-rag bench``: every timing side by side in one run, one module
per section (``ttft``, ``prefill``, ``store``, ``deviation``, ``ingest``, ``throughput``, ``round``,
``serve``, and ``vllm`` and ``codec``, which run only when named with ``--only``). Each section's module
holds its runner, the frozen dataclass it returns (a :class:`.record.Record`, written to the results file
as the JSON object it always was) and its renderer, which reads that record back. :mod:`.results` reads
and writes the results file, :mod:`.report` puts the sections on the page (:mod:`.page`: a section's
header), :mod:`.plots` draws the figures."""

from .config import ALL_SECTIONS, OPTIONAL_SECTIONS, SECTIONS, BenchConfig, BenchContext
from .ingest import QUERY_METHODS
from .report import render_bench
from .results import RESULTS_NAME, load_previous, save_results
from .run import run_bench
from .serve import SERVE_METHODS, ServeLoadConfig
from .throughput import THROUGHPUT_METHODS
from .ttft import TTFT_COLUMNS

__all__ = [
    "ALL_SECTIONS",
    "OPTIONAL_SECTIONS",
    "QUERY_METHODS",
    "RESULTS_NAME",
    "SECTIONS",
    "SERVE_METHODS",
    "THROUGHPUT_METHODS",
    "TTFT_COLUMNS",
    "BenchConfig",
    "BenchContext",
    "ServeLoadConfig",
    "load_previous",
    "render_bench",
    "run_bench",
    "save_results",
]
