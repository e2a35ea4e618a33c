"""Results files and the machine they were measured on, for eval and bench alike."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch


def write_json_atomic(data: Any, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def machine_info() -> dict[str, Any]:
    """CPU, cores, library versions and threads: printed with every published number."""
    import transformers

    cpu = platform.processor() or platform.machine()
    simd: list[str] = []  # the vector extensions (vLLM's CPU kernels, oneDNN pick their code by them)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")):
                prefixes = ("avx", "amx", "sse4", "fma", "asimd", "sve")
                simd = sorted({f for f in line.split(":", 1)[1].split() if f.startswith(prefixes)})
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "simd": simd,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average": list(os.getloadavg()),
        "timestamp": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
