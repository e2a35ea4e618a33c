"""docs/architecture.md names the package's modules as they are: every path it names exists, and every
subpackage of the package is described."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "cacheblend_rag"
DOC = ROOT / "docs" / "architecture.md"


def named_paths(text: str) -> set[str]:
    """Back-quoted paths ending in .py or / (package-relative as the doc writes them)."""
    return {m for m in re.findall(r"`([\w/]+(?:\.py|/))`", text)}


def test_every_module_the_architecture_names_exists():
    text = DOC.read_text()
    names = named_paths(text)
    assert len(names) > 40
    missing = []
    for name in sorted(names):
        candidates = [PACKAGE / name, ROOT / name]
        # a module named inside its subpackage's bullet ("`runtime.py`" under models/)
        candidates += [folder / name for folder in PACKAGE.iterdir() if folder.is_dir()]
        candidates += [PACKAGE / "store" / "remote" / name, PACKAGE / "engine" / "vllm" / name]
        if not any(c.exists() for c in candidates):
            missing.append(name)
    assert missing == []


def test_every_subpackage_is_described():
    text = DOC.read_text()
    folders = [p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert [f for f in folders if f"`{f}/`" not in text] == []
