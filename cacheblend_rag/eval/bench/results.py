"""The bench results file (``docs/results/bench.json``): a new results object, and earlier results whose
sections a partial run keeps."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ...errors import CacheBlendError
from ...models.runtime import LayerwiseModel
from ..results import machine_info, write_json_atomic
from .config import BENCH_FORMAT, BenchConfig

RESULTS_NAME = "bench.json"


def new_results(
    config: BenchConfig, model: LayerwiseModel, previous: dict[str, Any] | None
) -> dict[str, Any]:
    """A results object for a run of ``config`` on ``model``, holding ``previous``'s sections and commands
    (when they are bench results) until this run replaces them."""
    results: dict[str, Any] = {
        "format": BENCH_FORMAT,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "model": {"name": model.name, "fingerprint": model.fingerprint, "dtype": str(model.dtype)},
        "machine": machine_info(),
        "commands": {},
        "sections": {},
    }
    if previous is not None and previous.get("format") == BENCH_FORMAT:
        results["sections"].update(previous.get("sections", {}))
        results["commands"].update(previous.get("commands", {}))
    return results


def load_previous(path: Path, quick: bool) -> dict[str, Any] | None:
    """Earlier results at ``path``, to keep the sections not rerun (quick and full runs never mix)."""
    if not path.is_file():
        return None
    try:
        previous = json.loads(path.read_text())
    except ValueError as exc:
        raise CacheBlendError(f"cannot read earlier bench results {path}: {exc}") from exc
    return previous if bool(previous.get("config", {}).get("quick")) == quick else None


def save_results(results: dict[str, Any], path: Path) -> None:
    write_json_atomic(results, path)
