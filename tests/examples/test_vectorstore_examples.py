"""The two vector-store examples (the README's code for LangChain and LlamaIndex users starting from their
own documents) run end to end in a fresh corpus folder, each in its own process, and reuse chunk KV."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"
README = Path(__file__).parents[2] / "README.md"
CASES = {"langchain_vectorstore.py": "cacheblend", "llamaindex_vectorstore.py": "VectorStoreIndex"}
LINE = r"{label}\s+TTFT\s+(\d+) ms, (\d+)/(\d+) prompt tokens reused: (.+)"


def readme_block(script: str) -> str:
    """The code between the example's README markers."""
    text = (EXAMPLES / script).read_text()
    return text.split("# -- README:", 1)[1].split("\n", 1)[1].split("    # -- end --", 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("script", list(CASES))
def test_vectorstore_example_runs_and_reuses_chunk_kv(script, tmp_path):
    args = ["--corpus", str(tmp_path / "my-corpus"), "--files", "1", "--questions", "1", "--max-tokens", "8"]
    for run in (1, 2):  # a second run over the same folder replaces the documents, and still reuses
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, done.stderr[-3000:]
        found = re.search(LINE.format(label=CASES[script]), done.stdout)
        assert found, f"run {run}: no reuse line in:\n{done.stdout}"
        ttft, reused, prompt, answer = found.groups()
        assert int(ttft) > 0 and 0 < int(reused) < int(prompt) and answer.strip(), found.group(0)


def code_only(text: str) -> str:
    """``text`` without comments and whitespace, so code reads the same however it is wrapped."""
    return re.sub(r"\s+", "", re.sub(r"(^|\s)#\s.*$", "", text, flags=re.MULTILINE))


@pytest.mark.parametrize("script", list(CASES))
def test_readme_shows_the_examples_code(script):
    """The README's section for each framework holds the example's code, statement for statement, which
    the test above runs."""
    assert code_only(readme_block(script)) in code_only(README.read_text()), f"README lacks examples/{script}"
