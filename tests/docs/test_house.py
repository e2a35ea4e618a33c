"""The product stays apart from the lab: nothing outside the package imports its private names, and every
script and tool is run by a make target or a test (an unrun script rots, and a one-off experiment whose
finding is written down is deleted rather than kept)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = ("scripts", "tools", "tests", "examples", "integrations")


def private_imports(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line module:name`` for each private name ``path`` imports from the package (or from a
    private module of it)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cacheblend_rag"):
            module_private = any(part.startswith("_") for part in node.module.split("."))
            for alias in node.names:
                if module_private or alias.name.startswith("_"):
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.module}:{alias.name}")
    return found


def test_no_file_outside_the_package_imports_its_private_names():
    files = [p for folder in OUTSIDE for p in (ROOT / folder).rglob("*.py") if ".venv" not in p.parts]
    assert len(files) > 100
    assert [hit for path in files for hit in private_imports(path)] == []


def test_private_imports_are_found(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from cacheblend_rag.blend import probe\nfrom cacheblend_rag.blend.probe import _hidden\n"
    )
    assert private_imports(probe, tmp_path) == ["probe.py:2 cacheblend_rag.blend.probe:_hidden"]


def test_scripts_are_few_and_each_is_run_by_make_or_a_test():
    scripts = sorted(p for p in (ROOT / "scripts").glob("*.py"))
    assert len(scripts) <= 6, [p.name for p in scripts]
    runners = (ROOT / "Makefile").read_text() + "".join(
        p.read_text() for p in (ROOT / "tests").rglob("*.py") if p.name != Path(__file__).name
    )
    tools = sorted((ROOT / "tools").glob("*.py"))
    run = [p for p in scripts + tools if str(p.relative_to(ROOT)) in runners or f'"{p.name}"' in runners]
    # a script that only holds what a run script imports (scripts/ is on sys.path when one runs)
    imported = "".join(p.read_text() for p in run)
    unrun = [
        str(p.relative_to(ROOT))
        for p in scripts + tools
        if p not in run and f"import {p.stem}" not in imported and f"from {p.stem} import" not in imported
    ]
    assert unrun == []


def test_the_records_read_as_today_s_truth():
    """BENCHMARKS.md has no two sections of one title, README.md stays short, and no issue numbers reach
    the code or the user docs (they mean nothing to a reader)."""
    import re
    from collections import Counter

    titles = Counter(
        line.strip() for line in (ROOT / "BENCHMARKS.md").read_text().splitlines() if line.startswith("#")
    )
    assert [title for title, n in titles.items() if n > 1] == []
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
    numbered = re.compile(r"issue #?[0-9]+", re.IGNORECASE)
    paths = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "cacheblend_rag").rglob("*.py")]
    paths += [*(ROOT / "integrations").rglob("*.py")]
    assert [str(p.relative_to(ROOT)) for p in paths if numbered.search(p.read_text())] == []
