"""What a corpus hands out and takes: a retrieved chunk (:class:`RetrievedChunk`), a store's counts
(:class:`CorpusStats`), the checks of a question and a chunk count, and what a chunk is embedded as."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidQueryError
from ..text.chunker import Chunk
from ..text.document import Document
from .chunkdb import ChunkRow
from .documents import MAX_TOP_K
from .manifest import CorpusManifest


def check_top_k(top_k: object) -> int:
    """``top_k`` if it is a chunk count retrieval takes (1..MAX_TOP_K; 0 is refused, never "the
    default"), else :class:`InvalidQueryError` naming it."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
        raise InvalidQueryError(f"top_k must be an integer between 1 and {MAX_TOP_K}, got {top_k!r}")
    return top_k


@dataclass(frozen=True)
class RetrievedChunk:
    """A chunk as retrieval returns it: stored text and token ids, similarity score, provenance."""

    chunk_id: str
    text: str
    token_ids: tuple[int, ...]
    score: float  # cosine similarity to the question; NaN when the chunk was fetched by id or text
    title: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    kv_key: str = ""

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class CorpusStats:
    """Counts and settings of a store."""

    corpus_dir: str
    model: str
    model_fingerprint: str
    embedder: str
    index_type: str
    chunk_tokens: int
    files: int
    documents: int
    chunks: int
    tokens: int
    kv_ready: int
    index_size: int

    @classmethod
    def of(
        cls, corpus_dir: str, manifest: CorpusManifest, counts: dict[str, int], index_size: int
    ) -> CorpusStats:
        """A store's counts (``ChunkDB.counts``) with its manifest's settings."""
        m = manifest
        return cls(
            corpus_dir=corpus_dir,
            model=m.model,
            model_fingerprint=m.model_fingerprint,
            embedder=m.embedder,
            index_type=m.index_type,
            chunk_tokens=m.chunk_tokens,
            files=counts["files"],
            documents=counts["documents"],
            chunks=counts["chunks"],
            tokens=counts["tokens"],
            kv_ready=counts["kv_ready"],
            index_size=index_size,
        )


def retrieved_chunk(row: ChunkRow, score: float) -> RetrievedChunk:
    """A stored chunk row as retrieval returns it, with its ``score``."""
    return RetrievedChunk(
        row.chunk_id, row.text, row.token_ids, score, row.title, dict(row.metadata), row.kv_key
    )


def check_question(question: object) -> None:
    """Refuse a question retrieval cannot embed (empty, not a string, not valid Unicode), naming why."""
    if not isinstance(question, str) or not question.strip():
        raise InvalidQueryError("the question is empty")
    try:
        question.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidQueryError(
            f"the question is not valid Unicode: lone surrogate at character {exc.start}"
        ) from None


def embedding_text(doc: Document, chunk: Chunk) -> str:
    """What a chunk is embedded as."""
    # the title gives a chunk cut from the middle of a document the topic its own text may not name
    return f"{doc.title}\n{chunk.text}" if doc.title else chunk.text
