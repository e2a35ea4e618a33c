"""A package's public names loaded on first use (PEP 562's module ``__getattr__``), so that importing the
package stays cheap for whoever needs one module of it."""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from typing import Any


def load_export(package: str, exports: Mapping[str, str], name: str, namespace: dict[str, Any]) -> Any:
    """``name`` from the submodule ``exports`` names for it, kept in the package's ``namespace`` (its
    ``globals()``) so the next lookup finds it there."""
    module = exports.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", package), name)
    namespace[name] = value
    return value
