"""Fixtures of the CLI tests: the ``store`` commands run over the store tests' synthetic chunk KV, so their
``shape`` and ``make_kv`` fixtures (and ``store_support``) are taken from tests/store/conftest.py, not
copied."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_NAME = "store_tests_conftest"
_spec = importlib.util.spec_from_file_location(_NAME, Path(__file__).parents[1] / "store" / "conftest.py")
_store_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_store_fixtures)  # registers store_support too
sys.modules[_NAME] = _store_fixtures

shape = _store_fixtures.shape
make_kv = _store_fixtures.make_kv
