"""The three examples run end to end (as a user runs them) on the sample store, each in its own process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"
# Per script, the lines it prints per question: (label, whether chunk KV is reused on that line).
CASES = {
    "quickstart.py": [("full_recompute", False), ("cacheblend", True)],
    "langchain_rag.py": [("full prefill", False), ("cacheblend", True)],
    "llamaindex_rag.py": [("CacheBlendQueryEngine", True), (r"stock \+ recognition", True)],
}
LINE = r"{label}\s+TTFT\s+(\d+) ms, (\d+)/(\d+) prompt tokens reused: (.+)"


@pytest.mark.slow
@pytest.mark.parametrize("script", list(CASES))
def test_example_runs_and_reuses_chunk_kv(script, shared_rag_store):
    # the session's shared copy: with --lazy-kv a chunk's KV is computed on first use, so an example's
    # "reused" line needs chunks an earlier query (quickstart's, the first case) computed; a fresh copy
    # of the sample store has none (the examples only read its documents)
    args = [
        "--corpus",
        str(shared_rag_store),
        "--lazy-kv",
        "--questions",
        "1",
        "--top-k",
        "2",
        "--max-tokens",
        "8",
    ]
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # the examples show the library used as intended: none of them sets off its own advice
    assert "no stored chunk" not in done.stderr, done.stderr[-3000:]
    out = done.stdout
    for label, reuses in CASES[script]:
        found = re.search(LINE.format(label=label), out)
        assert found, f"no {label!r} line in:\n{out}"
        ttft, reused, prompt, answer = found.groups()
        assert int(ttft) > 0 and int(prompt) > 0 and answer.strip()
        assert (0 < int(reused) < int(prompt)) if reuses else int(reused) == 0, found.group(0)
    if script != "quickstart.py":
        assert re.search(r"Streaming.*\n  \S", out), out  # a streamed answer follows
