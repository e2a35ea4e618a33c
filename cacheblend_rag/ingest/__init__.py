"""From files to a store directory: readers, the token-id chunker and the ingest pipeline."""

from typing import Any

from .chunker import Chunk, Chunker, chunk_id_for, validate_chunk_id
from .readers import Document, read_file

__all__ = [
    "Chunk",
    "Chunker",
    "Document",
    "IngestSummary",
    "chunk_id_for",
    "ingest",
    "read_file",
    "validate_chunk_id",
]


def __getattr__(name: str) -> Any:
    # the pipeline imports the retrieval layer, which imports the chunker from here: load it on first use
    if name in ("ingest", "IngestSummary"):
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
