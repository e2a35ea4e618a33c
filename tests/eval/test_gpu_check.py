"""The accelerator check (``python -m cacheblend_rag.eval.gpu``, ``cacheblend-rag gpu-check``) runs on CPU
with the tiny config, so the path a GPU machine runs cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cacheblend_rag.cli import app
from cacheblend_rag.eval.gpu import check

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    """The check as a GPU machine starts it: its own process, the package's module."""
    return subprocess.run(
        [sys.executable, "-m", "cacheblend_rag.eval.gpu", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_tiny_config_on_cpu_times_every_method_and_checks_r1(tmp_path):
    out = tmp_path / "gpu.json"
    done = run(
        "--device",
        "cpu",
        "--config",
        "tiny",
        "--workloads",
        "3x32,2x64",
        "--json",
        str(out),
        "--profile",
        "--batch",
        "2",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "r = 1 matches full prefill" in done.stdout
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["repeats"] == 5
    assert result["forbidden_imports"] == [] and result["r1_ok"] is True and result["failures"] == []
    assert [row["workload"] for row in result["rows"]] == ["3x32", "2x64"]
    for row in result["rows"]:
        assert row["r1_relative_error"] <= row["r1_bound"] == 1e-4
        # every method on both fusion paths: the static steps (plain labels) and the layer passes
        for label in ("cacheblend", "cacheblend_hkvd", "full_reuse", "epic"):
            assert row[f"{label}_ram_s"] > 0 and row[f"{label}_layers_ram_s"] > 0
            # int8 chunk KV decoded joined per layer: the static steps only
            assert row[f"{label}_int8_ram_s"] > 0 and f"{label}_layers_int8_ram_s" not in row
            assert 0 < row[f"{label}_compute_fraction"] < 1  # fresh text computed, most chunk KV reused
        assert row["full_prefill_s"] == min(row["full_prefill_layers_s"], row["full_prefill_static_s"]) > 0
        assert row["prompt_tokens"] == 24 + 32 + int(row["workload"].split("x")[0]) * int(
            row["workload"].split("x")[1]
        )
    # --profile: where the time goes at the first workload, every path
    [profile] = result["profiles"]
    assert profile["workload"] == "3x32"
    methods = ["cacheblend", "cacheblend_hkvd", "full_reuse", "epic"]
    labels = ["full_prefill", "full_prefill_static", *methods, *(f"{m}_layers" for m in methods)]
    assert [found["label"] for found in profile["runs"]] == labels
    assert all(found["finish_s"] > 0 and found["kernels"] == 0 for found in profile["runs"])  # (no device)
    # --batch: two prompts at once at the first workload, full prefill batched against fuse_many
    [batch] = result["batches"]
    assert batch["workload"] == "3x32" and batch["batch"] == 2 and batch["full_prefill_s"] > 0
    assert all(batch[f"{label}_s"] > 0 for label in methods)
    # --render: the saved run as the markdown BENCHMARKS.md shows, without running anything
    rendered = run("--render", str(out))
    assert rendered.returncode == 0, rendered.stderr
    assert "| tiny | 3x32 | 152 |" in rendered.stdout and "| tiny | 2x64 | 184 |" in rendered.stdout
    assert (
        "Where the time goes, tiny 3x32" in rendered.stdout
        and "2 prompts at once, tiny 3x32" in rendered.stdout
    )


def test_bad_arguments_are_named():
    bad_workload = run("--device", "cpu", "--config", "tiny", "--workloads", "6by512")
    assert bad_workload.returncode != 0 and "bad workload '6by512'" in bad_workload.stderr
    bad_config = run("--device", "cpu", "--config", "llama-9")
    assert bad_config.returncode != 0 and "unknown config llama-9" in bad_config.stderr
    too_few = run("--device", "cpu", "--config", "tiny", "--repeats", "3")
    assert too_few.returncode != 0 and "at least 5" in too_few.stderr


def test_a_path_that_raises_is_named_and_the_rest_still_runs(tmp_path, monkeypatch):
    """One broken method costs neither the table nor the other methods' numbers: its cell says FAILED,
    the JSON names it under ``failures`` and the script exits non-zero."""
    from cacheblend_rag.blend import CacheBlend, methods, register_method

    # registered in a copy of the registry, gone after the test
    monkeypatch.setattr(methods, "_REGISTRY", dict(methods._REGISTRY))

    @register_method
    class RaisingForGpuCheck(CacheBlend):
        name = "raising_for_gpu_check"

        def layer0_positions(self, plan) -> torch.Tensor:
            raise RuntimeError("indices should be on the same device")

        def static_selection(self, plan, num_layers):
            raise RuntimeError("indices should be on the same device")

    monkeypatch.setitem(check.METHODS, "broken", ("raising_for_gpu_check", {}))
    # (in-process, the rest of the suite has imported what a GPU machine lacks: that check is the
    # subprocess test's, above)
    monkeypatch.setattr(check, "FORBIDDEN_IMPORTS", ())
    out = tmp_path / "gpu.json"
    # through the command line's passthrough: the same arguments reach the check
    result = CliRunner().invoke(
        app, ["gpu-check", "--device", "cpu", "--config", "tiny", "--workloads", "2x32", "--json", str(out)]
    )
    assert result.exit_code == 1, result.output
    printed = result.output
    assert "FAILED" in printed and "3 path(s) raised" in printed
    result = json.loads(out.read_text())
    raised = "ram: RuntimeError: indices should be on the same device"
    assert result["failures"] == [
        f"tiny 2x32 broken {raised}",
        f"tiny 2x32 broken_layers {raised}",
        f"tiny 2x32 broken int8_{raised}",
    ]
    (row,) = result["rows"]
    assert row["broken_ram_error"].startswith("RuntimeError") and "broken_ram_s" not in row
    for label in ("cacheblend", "cacheblend_hkvd", "full_reuse", "epic"):
        assert row[f"{label}_ram_s"] > 0 and row[f"{label}_layers_ram_s"] > 0  # every other path timed
    assert result["r1_ok"] is True


def test_benchmarks_gpu_tables_are_the_saved_runs_rendered():
    """Every GPU table in BENCHMARKS.md (section ``gpu``) is ``--render`` of a committed run: no GPU number
    there is typed by hand or estimated."""
    page = (REPO / "BENCHMARKS.md").read_text()
    for name in ("gpu-check-h100.json", "gpu-check-h100-1.5b.json", "gpu-check-h100-compile-default.json"):
        rendered = run("--render", str(REPO / "docs" / "results" / name))
        assert rendered.returncode == 0, rendered.stderr
        assert rendered.stdout.strip() in page, f"BENCHMARKS.md does not show {name} as rendered"


def test_the_command_line_passes_help_to_the_check():
    result = CliRunner().invoke(app, ["gpu-check", "--help"])
    assert result.exit_code == 0
    # its own usage line; the description still says how to run it where only torch is installed
    assert result.output.startswith("usage: cacheblend-rag gpu-check [-h]") and "--workloads" in result.output
    assert "python -m cacheblend_rag.eval.gpu" in result.output
    assert run("--help").stdout.startswith("usage: python -m cacheblend_rag.eval.gpu [-h]")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there: the check would run")
def test_without_a_gpu_the_error_names_device_cpu():
    result = CliRunner().invoke(app, ["gpu-check", "--config", "tiny"], env={"COLUMNS": "300"})
    assert result.exit_code == 2
    words = " ".join(result.output.split())
    assert "cacheblend-rag gpu-check: error: --device cuda, but torch sees no CUDA device" in words
    assert "give --device cpu to check every path on the CPU" in words
