"""scripts/gpu_check.py runs on CPU with the tiny config, so the path a GPU machine runs cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_tiny_config_on_cpu_times_every_method_and_checks_r1(tmp_path):
    out = tmp_path / "gpu.json"
    done = run("--device", "cpu", "--config", "tiny", "--workloads", "3x32,2x64", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "r = 1 matches full prefill" in done.stdout
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["repeats"] == 5
    assert result["forbidden_imports"] == [] and result["r1_ok"] is True and result["failures"] == []
    assert [row["workload"] for row in result["rows"]] == ["3x32", "2x64"]
    for row in result["rows"]:
        assert row["r1_relative_error"] <= row["r1_bound"] == 1e-4
        for label in ("cacheblend", "cacheblend_hkvd", "full_reuse", "epic"):
            assert row[f"{label}_ram_s"] > 0
            assert 0 < row[f"{label}_compute_fraction"] < 1  # fresh text computed, most chunk KV reused
        assert row["full_prefill_s"] > 0
        assert row["prompt_tokens"] == 24 + 32 + int(row["workload"].split("x")[0]) * int(
            row["workload"].split("x")[1]
        )


def test_bad_arguments_are_named():
    bad_workload = run("--device", "cpu", "--config", "tiny", "--workloads", "6by512")
    assert bad_workload.returncode != 0 and "bad workload '6by512'" in bad_workload.stderr
    bad_config = run("--device", "cpu", "--config", "llama-9")
    assert bad_config.returncode != 0 and "unknown config llama-9" in bad_config.stderr
    too_few = run("--device", "cpu", "--config", "tiny", "--repeats", "3")
    assert too_few.returncode != 0 and "at least 5" in too_few.stderr
