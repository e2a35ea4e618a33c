"""The chunk context of a corpus: what a new corpus records, and the upgrade of an older corpus to it."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from ..blend.segments import ChunkContext
from ..config import DEFAULT_CHUNK_CONTEXT
from ..models.tokenizer import ModelTokenizer, chunk_context_ids
from ..store.kvstore import KVStore
from .chunkdb import ChunkDB
from .manifest import FORMAT_VERSION, CorpusManifest, format_for

log = logging.getLogger(__name__)


def new_chunk_context(model: ModelTokenizer, kind: str = DEFAULT_CHUNK_CONTEXT) -> ChunkContext:
    """The chunk context a corpus created now records: of ``kind`` ('neutral' or 'none', the
    ``chunk_context`` setting), for ``model``'s tokenizer."""
    return ChunkContext(chunk_context_ids(model.tokenizer, kind))


def upgrade_format(
    db: ChunkDB, corpus_dir: Path, manifest: CorpusManifest, context: ChunkContext, store: KVStore
) -> tuple[CorpusManifest, list[str]]:
    """Bring a corpus of an older format to the current one: every chunk's KV key moves to ``context``
    (as ``store``, the corpus's KV store, keys it) and its KV is marked as not computed (ingest then
    precomputes it). Returns the new manifest and the now stale KV keys."""
    stale = db.rekey_kv(lambda ids: store.chunk_key(ids, context.key))
    upgraded = replace(
        manifest, format_version=format_for(manifest.kv_dtype), chunk_context=context.token_ids
    )
    upgraded.save(corpus_dir)
    log.info(
        "corpus %s upgraded from format %d to %d: chunk KV is recomputed behind the %d-token chunk context",
        corpus_dir,
        manifest.format_version,
        FORMAT_VERSION,
        len(context),
    )
    return upgraded, stale
