"""tools/check_import_cycles.py (``make lint``) passes on the package and fails on a module-level cycle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "check_import_cycles.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, check=False
    )


def write_package(root: Path, files: dict[str, str]) -> Path:
    package = root / "cacheblend_rag"
    for name, text in {"__init__.py": "", **files}.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


def test_the_package_has_no_module_level_cycle():
    done = run()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no module-level import cycles" in done.stdout
    assert "known import cycle" not in done.stdout  # none tolerated: KNOWN_CYCLES is empty


def test_a_cycle_between_two_modules_of_a_package_fails_naming_both(tmp_path):
    package = write_package(
        tmp_path,
        {
            "engine/__init__.py": "",
            "engine/engine.py": "from .scheduler import BatchScheduler\n",
            "engine/scheduler.py": "import os\n\nfrom . import engine\n",
            "engine/base.py": "from .engine import Engine\n",  # into the cycle, not part of it
        },
    )
    done = run(str(package))
    assert done.returncode == 1, done.stdout
    assert "import cycle in cacheblend_rag.engine: engine <-> scheduler" in done.stdout
    assert "cacheblend_rag.engine.scheduler (line 3) imports cacheblend_rag.engine.engine" in done.stdout
    assert "base" not in done.stdout.split("\n")[0]


def test_a_cycle_through_subpackages_fails(tmp_path):
    package = write_package(
        tmp_path,
        {
            "store/__init__.py": "from .kv import KVStore\n",
            "store/kv.py": "from ..corpus.db import ChunkDB\n",
            "corpus/__init__.py": "",
            "corpus/db.py": "from ..store import KVStore\n",
        },
    )
    done = run(str(package))
    assert done.returncode == 1 and "import cycle in cacheblend_rag: corpus <-> store" in done.stdout


def test_a_deferred_import_is_not_a_cycle_but_a_type_checking_one_is(tmp_path):
    files = {
        "engine/__init__.py": "",
        "engine/engine.py": "from .scheduler import BatchScheduler\n",
        "engine/scheduler.py": "def make():\n    from .engine import Engine\n\n    return Engine\n",
    }
    done = run(str(write_package(tmp_path / "deferred", files)))
    assert done.returncode == 0, done.stdout
    files["engine/scheduler.py"] = (
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .engine import E\n"
    )
    done = run(str(write_package(tmp_path / "typed", files)))
    assert done.returncode == 1 and "engine <-> scheduler" in done.stdout
