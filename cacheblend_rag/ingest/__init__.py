"""From files to a corpus directory: readers and the ingest pipeline (read, chunk, embed, index,
precompute KV)."""

from .kv import ChunkKVWriter, precompute_pending
from .pipeline import IngestSummary, ingest
from .readers import SUPPORTED_SUFFIXES, discover, read_file

__all__ = [
    "SUPPORTED_SUFFIXES",
    "ChunkKVWriter",
    "IngestSummary",
    "discover",
    "ingest",
    "precompute_pending",
    "read_file",
]
