"""Every Python snippet of README.md and the integrations' READMEs, and every example, runs as a user runs
it: in its own process, offline, from a folder holding what the snippet names (`my-documents/`, a
`my-corpus` built by `cacheblend-rag ingest`), and exits cleanly: status 0, and nothing on stderr from a
crash at shutdown.

A snippet that continues another (the structured-output one continues the LangChain one) or names a
variable the README leaves to the reader (`questions`, `splits`, `documents`) runs after the short
prelude given here. ``SNIPPET_RUNS`` (default 1) runs each that many times: `make test-snippets` runs
each 5 times, since a crash at exit may show in only some runs (CI: once, after `make test`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
READMES = [ROOT / "README.md", *sorted((ROOT / "integrations").glob("*/README.md"))]
RUNS = int(os.environ.get("SNIPPET_RUNS", "1"))
# what a crash, or a thread or pool outliving the interpreter, leaves on stderr
SHUTDOWN_NOISE = ("terminate called", "Traceback", "Exception ignored", "Fatal Python error", "leaked")

QUESTIONS = """from cacheblend_rag import CacheBlendRAG

questions = ["Who wrote Emilia Galotti?", "Who wrote Nathan the Wise?"]
"""
SPLITS = """from langchain_core.documents import Document

splits = [
    Document(page_content="Emilia Galotti is a play by Lessing.", metadata={"source": "a.md"}),
    Document(page_content="Nathan the Wise is a play by Lessing.", metadata={"source": "b.md"}),
]
"""
DOCUMENTS = """from pathlib import Path

from llama_index.core import Document

paths = sorted(Path("my-documents").glob("*"))
documents = [Document(text=p.read_text(encoding="utf-8"), id_=p.name) for p in paths]
"""


def snippets() -> dict[str, str]:
    """Each README's Python blocks by ``README path#index``."""
    found = {}
    for readme in READMES:
        blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.DOTALL)
        for i, block in enumerate(blocks):
            found[f"{readme.relative_to(ROOT)}#{i}"] = block
    return found


SNIPPETS = snippets()
# Each example with the smallest arguments that go through its whole path (tests/examples checks what they
# print); the demo as `make demo` runs it.
SMALL = ["--questions", "1", "--max-tokens", "8"]
EXAMPLES = {
    "demo.py": [],
    "quickstart.py": ["--corpus", "my-corpus", "--lazy-kv", "--top-k", "2", *SMALL],
    "langchain_rag.py": ["--corpus", "my-corpus", "--lazy-kv", "--top-k", "2", *SMALL],
    "llamaindex_rag.py": ["--corpus", "my-corpus", "--lazy-kv", "--top-k", "2", *SMALL],
    "langchain_vectorstore.py": ["--corpus", "new-corpus", "--files", "1", *SMALL],
    "llamaindex_vectorstore.py": ["--corpus", "new-corpus", "--files", "1", *SMALL],
}


def prelude(block: str) -> str:
    """What a fragment needs before it: the block it continues, or the variables it leaves to the reader."""
    if block.lstrip().startswith("from pydantic import BaseModel") and "structured_chain" in block:
        return next(b for b in SNIPPETS.values() if "ChatCacheBlend(corpus_dir=corpus_dir" in b)
    if ".check(questions" in block:
        return QUESTIONS
    if "from_documents(splits" in block and "splits =" not in block:
        return SPLITS
    if "from_documents(\n    documents," in block and "documents =" not in block:
        return DOCUMENTS
    return ""


def test_every_readme_block_and_example_is_found():
    # README.md: quickstart, LangChain, LlamaIndex, structured output, a custom method, check
    assert sum(key.startswith("README.md#") for key in SNIPPETS) == 6
    assert len(SNIPPETS) >= 11
    assert sorted(EXAMPLES) == sorted(p.name for p in (ROOT / "examples").glob("*.py"))


@pytest.fixture(scope="module")
def workdir_source(tmp_path_factory, sample_store) -> Path:
    """What every run starts from: the sample documents as `my-documents/`, the sample corpus as
    `my-corpus/` (ingested, chunk KV computed on first use) and `examples/` as in the repository."""
    base = tmp_path_factory.mktemp("snippet-source")
    shutil.copytree(ROOT / "examples" / "data" / "corpus", base / "my-documents")
    shutil.copytree(sample_store, base / "my-corpus")
    (base / "examples").symlink_to(ROOT / "examples")
    return base


def run_clean(name: str, argv: list[str], workdir_source: Path, tmp_path: Path, write=None) -> None:
    """Run ``argv`` ``RUNS`` times, each in a fresh copy of the work folder (``write(folder)`` first),
    offline, and check each exits 0 with no crash on stderr."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "CACHEBLEND_MAX_TOKENS": "16",  # the documented knob: short answers keep the runs short
    }
    env.pop("OPENAI_API_KEY", None)
    for run in range(RUNS):
        folder = tmp_path / f"run{run}"
        shutil.copytree(workdir_source, folder, symlinks=True)
        if write is not None:
            write(folder)
        done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
        where = f"{name}, run {run + 1} of {RUNS}"
        assert done.returncode == 0, f"{where}: exit {done.returncode}\n{done.stderr[-3000:]}"
        noise = [line for line in done.stderr.splitlines() if any(n in line for n in SHUTDOWN_NOISE)]
        assert noise == [], f"{where}:\n{done.stderr[-3000:]}"


@pytest.mark.snippets
@pytest.mark.parametrize("name", list(SNIPPETS))
def test_snippet_runs_offline_and_exits_cleanly(name, workdir_source, tmp_path):
    block = SNIPPETS[name]

    def write(folder: Path) -> None:
        # the quickstart writes to /tmp/corpus: here, its own folder
        code = prelude(block) + "\n" + block.replace('"/tmp/corpus"', repr(str(folder / "corpus")))
        (folder / "snippet.py").write_text(code)

    run_clean(name, [sys.executable, "snippet.py"], workdir_source, tmp_path, write)


@pytest.mark.snippets
@pytest.mark.parametrize("script", list(EXAMPLES))
def test_example_runs_offline_and_exits_cleanly(script, workdir_source, tmp_path):
    argv = [sys.executable, str(ROOT / "examples" / script), *EXAMPLES[script]]
    run_clean(f"examples/{script}", argv, workdir_source, tmp_path)
