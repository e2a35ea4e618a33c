"""Precomputing a corpus's chunk KV through an engine (the ingest pipeline's KV stage, and what a vector
store does when documents are added): :class:`ChunkKVWriter` is all it needs from the engine."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from ..blend.segments import ChunkContext
from ..corpus.corpus import Corpus
from ..engine.base import ModelIdentity
from ..store.kvstore import KVStore


class ChunkKVWriter(Protocol):
    """What the KV stage needs from an engine: the model it computes KV for, its KV store, and a way
    to precompute one chunk's KV into that store. Both engines are KV writers."""

    model: ModelIdentity
    store: KVStore

    chunk_context: ChunkContext

    def chunk_key(self, token_ids: Sequence[int]) -> str:
        """The store key of the chunk's KV."""
        ...

    def ensure_chunk_kv(self, token_ids: Sequence[int]) -> int:
        """Compute and store the chunk's KV unless present; the bytes written."""
        ...


def precompute_pending(
    corpus: Corpus,
    engine: ChunkKVWriter,
    progress: Callable[[int, int], None] | None = None,
    only: Collection[str] | None = None,
) -> tuple[int, int]:
    """Precompute the KV of every chunk of ``corpus`` not marked ready (of those in ``only``, chunk ids,
    when given), marking each once the store holds it (an interrupted run resumes where it stopped).
    Returns (chunks computed, bytes written); ``progress(done, total)`` after each chunk."""
    todo = corpus.db.pending_kv()
    if only is not None:
        wanted = set(only)
        todo = [(chunk_id, ids) for chunk_id, ids in todo if chunk_id in wanted]
    computed = written = 0
    for done, (chunk_id, token_ids) in enumerate(todo, start=1):
        nbytes = engine.ensure_chunk_kv(token_ids)
        corpus.db.mark_kv_ready(chunk_id, engine.chunk_key(token_ids))
        written += nbytes
        computed += 1 if nbytes else 0
        if progress is not None:
            progress(done, len(todo))
    return computed, written
