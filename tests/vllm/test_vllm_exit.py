"""A process that used the vLLM engine ends cleanly: an engine left open is shut down
before the interpreter exits, so vLLM's shutdown hooks never log into closed streams ("--- Logging error
--- ValueError: I/O operation on closed file")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm


def test_a_session_leaving_an_engine_open_ends_without_logging_errors():
    pytest.importorskip(
        "vllm", reason="vLLM is not installed here; `make test` runs tests/vllm in .venv-vllm"
    )
    child = Path(__file__).with_name("exit_child.py")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(child)],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ.copy(),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "1 passed" in output
    assert "Logging error" not in output and "I/O operation on closed file" not in output, output[-4000:]
