"""``run_bench``: run the configured sections, keeping the others from earlier results."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from ...models.loader import load_model
from ...models.runtime import LayerwiseModel
from ...records import OpenRecord
from ...settings import get_settings
from .codec import section_codec
from .config import BenchConfig, BenchContext, make_context
from .deviation import section_deviation
from .ingest import section_ingest
from .prefill import section_prefill
from .record import LoadAverage, SectionFrame
from .results import new_results
from .round import section_round
from .serve import section_serve
from .store import section_store
from .throughput import section_throughput
from .ttft import section_ttft
from .vllm import section_vllm

log = logging.getLogger(__name__)

# each returns its section's record (the results file holds its to_dict(), which the renderer reads back)
SECTION_FUNCTIONS: dict[str, Callable[[BenchContext], OpenRecord]] = {
    "ttft": section_ttft,
    "prefill": section_prefill,
    "store": section_store,
    "deviation": section_deviation,
    "ingest": section_ingest,
    "throughput": section_throughput,
    "round": section_round,
    "serve": section_serve,
    "vllm": section_vllm,
    "codec": section_codec,
}


def run_bench(
    config: BenchConfig,
    model: LayerwiseModel | None = None,
    previous: dict[str, Any] | None = None,
    command: str = "",
    on_section: Callable[[str, str], None] | None = None,
) -> dict[str, Any]:
    """Run the configured sections; sections not run are kept from ``previous`` (an earlier results
    object) so a partial rerun still yields a complete report."""
    model = model or load_model(config.model, config=get_settings())
    ctx = make_context(config, model)
    results = new_results(config, model, previous)
    try:
        for name in config.sections:
            if on_section is not None:
                on_section(name, "start")
            started, load_before = time.perf_counter(), os.getloadavg()
            section = SECTION_FUNCTIONS[name](ctx).to_dict()
            frame = SectionFrame(
                seconds=time.perf_counter() - started,
                load_average=LoadAverage(before=list(load_before), after=list(os.getloadavg())),
                machine=results["machine"],
            )
            log.info("bench section %s took %.1f s", name, frame.seconds)
            results["sections"][name] = section | frame.to_dict()
            results["commands"][name] = command
            if on_section is not None:
                on_section(name, "done")
    finally:
        shutil.rmtree(ctx.work_dir, ignore_errors=True)
    return results
