"""``store recode``: convert a corpus's chunk KV to another codec in place, crash-safe.

Order of work, so that a kill at any point leaves every chunk readable in one codec or the other:

1. every stored chunk is read (each layer checked), encoded in the new codec and written under its new
   key (atomically, as any write; to the remote tier too when the store has one); a chunk whose new file
   is already there (an earlier run that was killed) is skipped;
2. the chunk DB takes the new keys (one transaction), then the manifest the new codec (atomic rename):
   from then on engines opened on the corpus read the new files;
3. only then are the old files (and remote values) deleted, and killed writers' temp files removed.

Until step 2 the corpus reads the old files, which are still all there; after it, the new ones, which are
all there. Running the same command again after a crash finishes the job. A chunk whose old KV is
unreadable is marked not computed (ingest precomputes it again) rather than carried over.

A recode may only lose precision, never gain it: the new codec must rank below the one the KV is stored in
(float32 > float16 = bfloat16 > int8 > int4), or be the same. Every allowed recode goes down, so the
codec a corpus records is the coarsest its KV ever passed through, and that is enough to decide.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..blend.segments import ChunkContext, ChunkKV
from ..errors import CorruptKVError, StoreError
from ..store.keys import resolve_codec
from ..store.kvstore import KVStore
from .chunkdb import DB_NAME, ChunkDB
from .manifest import KV_DIR_NAME, CorpusManifest, format_for, legacy_codec

log = logging.getLogger(__name__)

# Decoding int4 and encoding the result as int8 would store int4's precision under int8's keys: bytes a
# fresh ingest never makes, so a copy of the key in another tier or node would differ from a recomputed
# one. float16 and bfloat16 share a rank because neither holds the other's values (mantissa vs range).
PRECISION = {"float32": 3, "float16": 2, "bfloat16": 2, "int8": 1, "int4": 0}


def check_recode(old: str, target: str) -> None:
    """Raise :class:`StoreError` when KV stored in ``old`` cannot be recoded to ``target`` because
    ``target`` is not coarser (see the module docstring)."""
    if target == old or PRECISION[target] < PRECISION[old]:
        return
    raise StoreError(
        f"cannot recode chunk KV from {old} to {target}: {target} is not coarser than {old}, and "
        f"{old}'s values re-encoded in {target} would differ from {target} KV computed from the model; "
        f"re-ingest the documents into a new corpus with CACHEBLEND_KV_DTYPE={target} instead"
    )


@dataclass
class RecodeReport:
    """What :func:`recode_corpus` did."""

    corpus_dir: str
    old_codec: str
    new_codec: str
    chunks: int = 0
    converted: int = 0
    already_done: int = 0  # new file there from an earlier, interrupted run
    not_stored: int = 0  # chunks whose KV was not computed: only their key changes
    unreadable: list[str] = field(default_factory=list)  # old keys; marked for recompute
    old_bytes: int = 0
    new_bytes: int = 0
    old_files_removed: int = 0
    remote: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def recode_corpus(
    corpus_dir: Path,
    new_codec: str,
    fallback_codec: str,
    remote: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> RecodeReport:
    """Convert ``corpus_dir``'s chunk KV to ``new_codec`` (see the module docstring). ``fallback_codec``:
    the codec of a corpus whose manifest records none (the kv_dtype setting); ``remote``: the remote tier
    URL ('' or None: none), whose values are converted too; ``progress(done, total)``: after each chunk of
    step 1."""
    corpus_dir = Path(corpus_dir)
    manifest = CorpusManifest.load(corpus_dir)
    if manifest is None:
        raise StoreError(f"{corpus_dir} is not a corpus directory (no manifest.json)")
    target = resolve_codec(new_codec).name
    old = resolve_codec(
        manifest.kv_dtype or legacy_codec(corpus_dir / KV_DIR_NAME, manifest, fallback_codec)
    ).name
    check_recode(old, target)  # before anything is opened: a refused recode changes nothing
    report = RecodeReport(str(corpus_dir), old, target, remote=bool(remote))
    context = ChunkContext(manifest.chunk_context).key
    root = corpus_dir / KV_DIR_NAME
    fingerprint = manifest.model_fingerprint
    db = ChunkDB(corpus_dir / DB_NAME)
    try:
        rows = db.kv_rows()
        if old != target:
            with (
                KVStore.open_existing(
                    root, fingerprint, kv_dtype=old, promote_on_read=False, remote=remote or ""
                ) as source,
                KVStore(
                    root, fingerprint, source.shape, target, ram_budget_bytes=0, remote=remote or ""
                ) as dest,
            ):
                keys = []
                for row in rows:
                    keys.append(_convert(row, source, dest, context, report))
                    if progress is not None:
                        progress(len(keys), len(rows))
            db.set_kv_keys(keys)
            recorded = replace(
                manifest, kv_dtype=target, format_version=format_for(target, manifest.format_version)
            )
            recorded.save(corpus_dir)
            log.info("corpus %s now stores chunk KV in %s (was %s)", corpus_dir, target, old)
        # step 3, also what finishes a run killed after step 2: KV of this model in any other codec goes
        report.old_files_removed = _sweep(root, fingerprint, target, rows, context, remote or "")
    finally:
        db.close()
    return report


def _convert(
    row, source: KVStore, dest: KVStore, context: str, report: RecodeReport
) -> tuple[int, str, bool]:
    """Step 1 for one chunk DB row: (row id, new key, whether the chunk's KV is stored under it)."""
    row_id, token_ids, _, ready = row
    report.chunks += 1
    new_key = dest.chunk_key(token_ids, context)
    if not ready:
        report.not_stored += 1
        return row_id, new_key, False
    if dest.disk.contains(new_key) and dest.get(new_key) is not None:  # an earlier run wrote it
        report.already_done += 1
        if dest.remote is not None:
            dest.pin(new_key)
        return row_id, new_key, True
    old_key = source.chunk_key(token_ids, context)
    found = source.get(old_key)
    try:
        if found is None:
            raise CorruptKVError(old_key, "not in the store", 0)
        layers = [found.layer(i) for i in range(found.num_layers)]
    except CorruptKVError as exc:
        log.warning("chunk KV %s… is unreadable (%s); it will be recomputed", old_key[:16], exc)
        report.unreadable.append(old_key)
        return row_id, new_key, False
    report.old_bytes += _file_size(source, old_key)
    kv = ChunkKV([k for k, _ in layers], [v for _, v in layers], found.fingerprint)
    dest.put(new_key, kv, ram=False, pinned=True)
    report.new_bytes += _file_size(dest, new_key)
    report.converted += 1
    return row_id, new_key, True


def _sweep(root: Path, fingerprint: str, target: str, rows, context: str, remote: str) -> int:
    """Delete this model's chunk KV in every codec but ``target`` (local files, and the remote values of
    the corpus's chunks); returns local files removed. Killed writers' temp files go too."""
    removed = 0
    with KVStore.open_existing(root, fingerprint, kv_dtype=target, remote=remote) as store:
        others = store.index.sql(
            "SELECT DISTINCT kv_dtype FROM chunks WHERE model_fingerprint = ? AND kv_dtype != ?",
            (fingerprint, target),
        )
        for (codec,) in others:
            with KVStore(root, fingerprint, store.shape, codec, remote=remote) as old:
                stored = old.index.sql(
                    "SELECT key FROM chunks WHERE model_fingerprint = ? AND kv_dtype = ?",
                    (fingerprint, codec),
                )
                for (key,) in stored:
                    removed += old.disk.delete(key)
                if old.remote is not None:
                    for _, token_ids, _, _ in rows:
                        old.remote.delete(old.chunk_key(token_ids, context))
            store.index.sql(
                "DELETE FROM models WHERE model_fingerprint = ? AND kv_dtype = ?", (fingerprint, codec)
            )
        store.disk.stale_temp_files(remove=True)
    return removed


def _file_size(store: KVStore, key: str) -> int:
    try:
        return store.path_for(key).stat().st_size
    except FileNotFoundError:
        return 0
