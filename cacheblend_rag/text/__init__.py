"""Text primitives below the corpus and the engine: documents, the token-id chunker, chunk ids and the
packed form of token ids."""

from .chunker import (
    CHUNK_ID_HEX_CHARS,
    Chunk,
    Chunker,
    chunk_id_for,
    pack_token_ids,
    unpack_token_ids,
    validate_chunk_id,
)
from .document import Document

__all__ = [
    "CHUNK_ID_HEX_CHARS",
    "Chunk",
    "Chunker",
    "Document",
    "chunk_id_for",
    "pack_token_ids",
    "unpack_token_ids",
    "validate_chunk_id",
]
