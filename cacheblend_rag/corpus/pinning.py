"""Pinning a corpus in the remote KV tier: every chunk whose KV is ready made corpus KV there (pushed from
the local tiers where the remote one lacks it). Ingest does it; a replica does it again when it sees the
tier came back without its pinned chunks (a restart without persistence, docs/remote_kv_tier.md)."""

from __future__ import annotations

from ..store.kvstore import KVStore
from .corpus import Corpus

PIN_BATCH = 1000  # chunk rows read at a time


def pin_corpus(corpus: Corpus, store: KVStore) -> int:
    """Pin every ready chunk of ``corpus`` in ``store``'s remote tier; the number pinned (0 without one)."""
    if store.remote is None:
        return 0
    ids = list(corpus.db.iter_chunk_ids())
    pinned = 0
    for first in range(0, len(ids), PIN_BATCH):
        rows = corpus.db.chunks_by_ids(ids[first : first + PIN_BATCH]).values()
        pinned += sum(store.pin(row.kv_key) for row in rows if row.kv_ready)
    return pinned
