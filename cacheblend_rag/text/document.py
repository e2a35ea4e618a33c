"""A document to chunk: text plus provenance, whatever it was read from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Document:
    """One document to chunk: its text plus where it came from."""

    text: str
    source: str  # the file it was read from
    key: str  # unique within the corpus: the file path, or "path#id" for a .jsonl record
    title: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
