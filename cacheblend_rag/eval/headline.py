"""BENCHMARKS.md's headline: the current default in one table, generated from the results files.

Read from a results folder (``docs/results``): the bench's ``bench.json`` (CPU TTFT at its headline size,
chunk KV bytes per token, scheduler throughput), the GPU check's file when one was measured, and every
eval results file run with the current methods revision that holds the default method beside full prefill
(per data set, chunk size and top-k, the file with the most cases). ``bench`` and ``eval --markdown``
rewrite it after their own sections, so it never shows a number no results file holds.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..blend.methods import METHODS_REVISION
from ..blend.spec import MethodSpec
from ..config import DEFAULT_KV_DTYPE, DEFAULT_METHOD, DEFAULT_RATIO
from ..engine.fidelity import REFERENCE, MethodRow
from .bench.codec import CodecResult
from .bench.record import SectionFrame
from .bench.throughput import ThroughputResult, scheduler_speedup
from .bench.ttft import TtftResult
from .markdown import fmt, table
from .records import CaseRecord, load_results
from .variants import run_spec

HEADLINE_SECTION = "headline"
BENCH_FILE = "bench.json"
# The GPU check's results the headline quotes (BENCHMARKS.md's gpu section has the command).
GPU_FILE = "gpu-check-h100.json"
GPU_SHAPE = ("llama-3.1-8b", "6x512")
_DEFAULT = MethodSpec.parse(DEFAULT_METHOD)
# the label eval gives the default (``--methods default``): the spec as it is, or with the default ratio
DEFAULT_LABEL = run_spec(_DEFAULT, DEFAULT_RATIO).label
# The default's method at the default ratio with a fixed budget: what the default computes for a request
# whose chunks its budget does not count as short (blend/budget.py, AdaptiveBudget); rows of files run
# before the budget adapted are the default's where every case's chunks were long.
FIXED_LABEL = MethodSpec.parse(_DEFAULT.name).with_ratio(DEFAULT_RATIO, where_taken=True).label


def render_headline(results_dir: Path) -> str:
    """The headline section's markdown for the results files in ``results_dir``."""
    bench = _read(results_dir / BENCH_FILE)
    speed = _speed_rows(bench, _read(results_dir / GPU_FILE))
    fidelity = _fidelity_rows(results_dir)
    lines = [
        f"## Headline: the default (`{DEFAULT_LABEL}`, {DEFAULT_KV_DTYPE} chunk KV)",
        "",
        "Generated from the results files under `docs/results/` by `make bench` and `make eval` (each row "
        "names its source; the sections below have the commands and machines).",
        "",
        table(["measure", "value", "source"], speed) if speed else "No bench results yet: run `make bench`.",
        "",
    ]
    if fidelity:
        lines += [
            f"Fidelity to full prefill on held-out cases (methods revision {METHODS_REVISION}; means over "
            "cases; TTFT speed-up: median over cases of full prefill's TTFT over the default's, CPU). A "
            f"source marked `{FIXED_LABEL}` is a run of the fixed default ratio on cases whose chunks are "
            "all long, where the default computes exactly that (its budget adapts to short chunks only):",
            "",
            table(
                [
                    "set",
                    "cases",
                    "cached tokens recomputed",
                    "first-token KL",
                    "first-token agreement",
                    "agreement F1",
                    "TTFT speed-up",
                    "source",
                ],
                fidelity,
            ),
        ]
    else:
        lines.append("No eval results of the current methods revision yet: run `make eval`.")
    return "\n".join(lines)


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass(frozen=True)
class GpuHeadline:
    """The default's speed-up the GPU check measured at :data:`GPU_SHAPE`, read from its results file
    (written by the accelerator check, :mod:`.gpu`, which runs where only torch is installed: plain JSON)."""

    speedup: float
    int8: bool  # the default codec in device memory (the run timed it), else float16 chunk KV
    fusion: str  # the first fusion path the run timed
    device: str
    torch: str

    @classmethod
    def read(cls, gpu: dict[str, Any]) -> GpuHeadline | None:
        row = next((r for r in gpu["rows"] if (r["config"], r["workload"]) == GPU_SHAPE), None)
        if row is None:
            return None
        int8 = row.get("cacheblend_int8_hbm_speedup") is not None
        speedup = row["cacheblend_int8_hbm_speedup"] if int8 else row.get("cacheblend_hbm_speedup")
        if speedup is None:
            return None
        fusion = gpu.get("fusion", "layers").split(",")[0]
        return cls(speedup, int8, fusion, gpu["device"], gpu["torch"])


def _speed_rows(bench: dict[str, Any] | None, gpu: dict[str, Any] | None) -> list[list[str]]:
    rows: list[list[str]] = []
    sections = (bench or {}).get("sections") or {}
    if "ttft" in sections:
        point = TtftResult.from_dict(sections["ttft"]).headline  # the bench's size, when swept
        if point is not None:
            times, when = point.ttft_s, _when(sections["ttft"])
            size = f"{point.num_chunks} × {point.chunk_tokens} tokens"
            rows.append(
                [f"CPU TTFT, full prefill / default, {size}, RAM tier", _times(times, "cacheblend_ram"), when]
            )
            if "cacheblend_disk" in times:
                rows.append(
                    [
                        "CPU TTFT, the same, disk tier (cold page cache)",
                        _times(times, "cacheblend_disk"),
                        when,
                    ]
                )
    measured = GpuHeadline.read(gpu) if gpu else None
    if measured is not None:
        # the default as an accelerator runs it: the static fusion (the first path timed) and, where the
        # run timed it, the default codec (int8) in device memory
        kv = "int8 chunk KV" if measured.int8 else "chunk KV"
        rows.append(
            [
                f"GPU TTFT, full prefill / default, {GPU_SHAPE[1].replace('x', ' × ')} tokens, "
                f"{GPU_SHAPE[0]} shape, {kv} in HBM ({measured.fusion} fusion)",
                f"{measured.speedup:.2f}×",
                f"`{GPU_FILE}`, {measured.device}, torch {measured.torch}",
            ]
        )
    if "codec" in sections:
        codec = CodecResult.from_dict(sections["codec"])
        sizes = codec.bytes_per_token.get(f"{codec.chunk_tokens}_token_chunks") or next(
            iter(codec.bytes_per_token.values())
        )
        if DEFAULT_KV_DTYPE in sizes:
            own = sizes[DEFAULT_KV_DTYPE]
            rows.append(
                [
                    f"chunk KV bytes per token ({DEFAULT_KV_DTYPE})",
                    f"{own.bytes_per_token:,.0f} ({own.vs_float16:.2f} of float16)",
                    _when(sections["codec"]),
                ]
            )
    if "throughput" in sections:
        throughput = ThroughputResult.from_dict(sections["throughput"])
        speedup = scheduler_speedup(throughput.runners, throughput.requests)
        if speedup is not None:
            rows.append(
                [
                    f"requests/s through the scheduler, default / full prefill, {throughput.requests} "
                    f"requests of {throughput.chunks_per_request} × {throughput.chunk_tokens} tokens",
                    f"{speedup:.2f}×",
                    _when(sections["throughput"]),
                ]
            )
    return rows


def _times(times: dict[str, float], method: str) -> str:
    full, own = times["full_prefill"], times[method]
    return f"{full / own:.2f}× ({full:.2f} s vs {own:.2f} s)"


def _when(section: dict[str, Any]) -> str:
    machine = SectionFrame.from_dict(section).machine
    day = str(machine.get("timestamp", "?"))[:10]
    return f"`{BENCH_FILE}`, {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, {day}"


def _fidelity_rows(results_dir: Path) -> list[list[str]]:
    best: dict[tuple[str, int, int], tuple[tuple[bool, int], str, MethodRow]] = {}
    for path in sorted(results_dir.glob("eval-*.json")):
        results = load_results(path)
        config, summary = results.config, results.summary
        if config.revision != METHODS_REVISION or config.kv_dtype != DEFAULT_KV_DTYPE or summary is None:
            continue
        methods = summary.methods
        label = DEFAULT_LABEL if DEFAULT_LABEL in methods else FIXED_LABEL
        if label not in methods or REFERENCE not in methods:
            continue
        if label == FIXED_LABEL and not _default_chose_fixed(results.cases):
            continue
        key = (config.dataset, config.chunk_tokens, config.top_k)
        row = methods[label]
        # a run of the default itself wins over one of its fixed equivalent, then the most cases
        rank = (label == DEFAULT_LABEL, row.cases)
        if key not in best or rank > best[key][0]:
            best[key] = (rank, path.name, row)
    rows = []
    for (dataset, tokens, top_k), ((own, cases), name, row) in sorted(best.items()):
        rows.append(
            [
                f"{dataset}, chunks ≤ {tokens} tokens, top {top_k}",
                str(cases),
                fmt(row.chunk_recompute_ratio),
                fmt(row.kl_first_token),
                fmt(row.first_token_agreement),
                fmt(row.agreement_f1),
                f"{row.speedup_median:.2f}×" if row.speedup_median else "–",
                f"`{name}`" if own else f"`{name}` (`{FIXED_LABEL}`)",
            ]
        )
    return rows


def _default_chose_fixed(cases: Sequence[CaseRecord]) -> bool:
    """Whether the default, given each case's retrieved chunks, would have recomputed exactly what
    ``FIXED_LABEL`` recomputed (its budget's choice for every case the fixed default ratio)."""
    method = _DEFAULT.build()
    for case in cases:
        choice = method.request_choice([chunk.tokens for chunk in case.retrieved])
        if choice is not None and (choice.kind != "fixed" or choice.ratio != DEFAULT_RATIO):
            return False
    return True
