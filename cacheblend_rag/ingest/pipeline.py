"""Ingest files into a corpus directory: read -> chunk -> embed -> index -> precompute KV.

Incremental and crash-safe:

- a file whose content hash is already recorded is skipped (re-ingesting an unchanged corpus does nothing);
- a changed file replaces its documents and chunks in one SQLite transaction, so a crash (even kill -9)
  leaves every file either fully old or fully new;
- a file recorded under a folder being ingested that is gone from it is forgotten: its documents, and the
  chunks no other document holds with their vectors and KV;
- content-identical chunks are stored, embedded and precomputed once;
- ``faiss.index`` is written atomically after the commits; a crash before that is detected by the
  recorded index version and the index is rebuilt from the stored embeddings on the next open;
- each chunk's KV is marked ready only after the KV store holds it, so an interrupted KV stage resumes
  where it stopped on the next run, even if no file changed;
- with a shared remote KV tier (setting ``kv_remote``), every chunk of the corpus ends up pinned there as
  corpus KV: a chunk the tier already holds is not computed again, and one only the local store holds is
  pushed, so rerunning ingest with a new tier publishes an existing corpus.

Every input is read and chunked before anything is written: a bad file stops the run with an
``IngestError`` and the corpus is left as it was.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from filelock import FileLock, Timeout

from ..blend.segments import ChunkContext
from ..config import DEFAULTS, Config
from ..corpus.context import new_chunk_context
from ..corpus.corpus import Corpus
from ..corpus.embedder import get_embedder
from ..corpus.index import check_index_type
from ..corpus.manifest import (
    FORMAT_VERSION,
    KV_DIR_NAME,
    CorpusManifest,
    check_compatible,
    check_new_corpus_dir,
    legacy_codec,
)
from ..corpus.pinning import pin_corpus
from ..engine import create_engine
from ..engine.session import check_engine_fits
from ..errors import IngestError, StoreError
from ..models.tokenizer import load_model_tokenizer
from ..store.shared import KVStoreOptions
from ..text import Chunk, Chunker, Document
from .kv import ChunkKVWriter, precompute_pending
from .readers import discover, read_bytes, read_file

log = logging.getLogger(__name__)

STAGES = ("read", "embed", "index", "kv")
ProgressCallback = Callable[[str, int, int], None]  # (stage, done, total)
_LOCK_NAME = ".ingest.lock"
_LOCK_TIMEOUT_S = 30.0


@dataclass
class IngestSummary:
    """What one ingest run did and how long it took."""

    corpus_dir: str
    files: int = 0  # input files found
    files_changed: int = 0  # new or modified files (re)ingested
    files_unchanged: int = 0
    documents: int = 0  # documents in the changed files
    chunks: int = 0  # chunk occurrences in the changed files
    new_chunks: int = 0  # distinct chunks the corpus did not hold
    removed_chunks: int = 0  # chunks no document uses any more (dropped with their KV)
    removed_files: int = 0  # files gone from an ingested folder, forgotten
    tokens: int = 0  # tokens of the chunk occurrences above
    kv_chunks: int = 0  # chunks whose KV was precomputed in this run
    kv_bytes: int = 0
    kv_remote_pinned: int | None = None  # chunks pinned in the remote KV tier (None: no remote tier)
    seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    # files left out because they could not be read (``skip_unreadable``): (path, why)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def work_seconds(self) -> float:
        """Time spent on the stages, without the one-time loading of tokenizer, embedder and model."""
        return sum(s for stage, s in self.stage_seconds.items() if stage != "load")

    @property
    def chunks_per_s(self) -> float:
        return self.chunks / self.work_seconds if self.work_seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.work_seconds if self.work_seconds > 0 else 0.0


@dataclass
class _FilePlan:
    path: Path
    content_hash: str
    size: int
    mtime: float
    documents: list[tuple[Document, list[Chunk]]]


def ingest(
    paths: Iterable[str | Path],
    corpus_dir: str | Path,
    model: str | Path | None = None,
    progress: ProgressCallback | None = None,
    *,
    chunk_tokens: int | None = None,
    index_type: str | None = None,
    embedder: str | None = None,
    precompute_kv: bool = True,
    engine: ChunkKVWriter | None = None,
    skip_unreadable: bool = False,
    config: Config = DEFAULTS,
) -> IngestSummary:
    """Ingest ``paths`` (files or folders) into ``corpus_dir``; see the module docstring.

    ``config``: the caller's settings, for what is not given here (the edges pass theirs). ``model``:
    model name or local folder (default: ``config.model``). ``chunk_tokens``, ``index_type``,
    ``embedder``: for a new corpus (default: ``config``'s, as its codec and chunk context, and the KV
    store's budgets and remote tier for every corpus); an existing corpus keeps its
    chunk size and embedder (passing others is refused) and adopts a new index type. ``engine``: an
    already loaded engine for the KV stage (any :class:`ChunkKVWriter`; by default the PyTorch engine is
    loaded on ``corpus_dir/kv``); with ``precompute_kv=False`` chunk KV is left for the engine to compute
    on first use. ``skip_unreadable``: a file that cannot be read (empty, not UTF-8, malformed) is left
    out and named in ``summary.skipped`` instead of stopping the run (if none can be read, the first
    problem is raised); either way nothing of a file is stored unless all of it is.
    """
    started = time.perf_counter()
    paths = list(paths)
    corpus_dir = Path(corpus_dir).expanduser()
    notify = progress or (lambda stage, done, total: None)
    if index_type is not None:
        check_index_type(index_type)
    files = discover(paths)
    tokenizer = load_model_tokenizer(model or config.model, config.home)
    embedder_model = get_embedder(embedder or config.embedder)
    manifest = CorpusManifest.load(corpus_dir) if corpus_dir.is_dir() else None
    if manifest is not None:
        check_compatible(corpus_dir, manifest, tokenizer, embedder_model, chunk_tokens)
        chunk_tokens = manifest.chunk_tokens
    else:
        check_new_corpus_dir(corpus_dir)
    # an older corpus is upgraded to the current chunk context when opened for writing below
    current = manifest is not None and manifest.format_version >= FORMAT_VERSION
    context = (
        ChunkContext(manifest.chunk_context)
        if current
        else new_chunk_context(tokenizer, config.chunk_context)
    )
    if engine is not None:  # the engine given for the KV stage
        check_engine_fits(str(corpus_dir), tokenizer.fingerprint, context, engine, tokenizer.name)
    if manifest is None:  # a new corpus: in the codec of the engine given to write its KV, else config's
        codec = engine.store.kv_dtype_name if engine is not None else config.kv_dtype
    else:
        codec = manifest.kv_dtype or legacy_codec(corpus_dir / KV_DIR_NAME, manifest, config.kv_dtype)
    if engine is not None and engine.store.kv_dtype_name != codec:
        raise StoreError(
            f"the engine given for the KV stage stores chunk KV in {engine.store.kv_dtype_name}, corpus "
            f"{corpus_dir} in {codec}; create it with store=Corpus.open(...).kv_store (or run "
            "cacheblend-rag store recode)"
        )
    chunker = Chunker(tokenizer.tokenizer, chunk_tokens or config.chunk_tokens)
    summary = IngestSummary(corpus_dir=str(corpus_dir), files=len(files))
    summary.stage_seconds["load"] = time.perf_counter() - started

    created = not corpus_dir.exists()
    try:
        corpus_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
    except OSError as exc:
        raise StoreError(f"cannot create corpus directory {corpus_dir}: {exc}") from exc
    lock = FileLock(str(corpus_dir / _LOCK_NAME), mode=0o644)
    try:
        lock.acquire(timeout=_LOCK_TIMEOUT_S)
    except Timeout:
        raise StoreError(
            f"another ingest is writing to {corpus_dir}; try again when it has finished"
        ) from None
    except OSError as exc:  # a read-only file system or folder
        raise StoreError(
            f"cannot write to store (corpus directory) {corpus_dir}: {exc.strerror or exc}"
        ) from exc
    corpus: Corpus | None = None
    kv_store = engine.store if engine is not None else None  # the corpus's store is the engine's
    opening = {
        "kv_options": replace(KVStoreOptions.of(config), kv_dtype=codec),
        "kv_store": kv_store,
        "chunk_context": config.chunk_context,
    }
    try:
        corpus = (
            Corpus.create(corpus_dir, tokenizer, embedder_model, chunk_tokens, index_type, **opening)
            if manifest is not None
            else None
        )
        plans = _read_stage(files, chunker, corpus, summary, notify, skip_unreadable)
        if corpus is not None:
            _prune_stage(corpus, paths, files, engine, summary)
        if corpus is None:
            corpus = Corpus.create(
                corpus_dir, tokenizer, embedder_model, chunker.max_tokens, index_type, **opening
            )
        index_changed = index_type is not None and manifest is not None and index_type != manifest.index_type
        removed_kv = corpus.stale_kv_keys + _embed_stage(plans, corpus, summary, notify)
        _index_stage(corpus, index_changed, summary, notify)
        if precompute_kv:
            _kv_stage(corpus, tokenizer.path, engine, removed_kv, summary, notify, config)
        else:
            corpus.documents.drop_kv(removed_kv)
    except BaseException:
        if created and corpus is None:
            shutil.rmtree(corpus_dir, ignore_errors=True)  # nothing was stored: leave no empty corpus behind
        raise
    finally:
        if corpus is not None:
            corpus.close()
        lock.release()
    summary.seconds = time.perf_counter() - started
    log.info(
        "ingested %d files (%d changed): %d chunks, %d new, %d tokens in %.1f s",
        summary.files,
        summary.files_changed,
        summary.chunks,
        summary.new_chunks,
        summary.tokens,
        summary.seconds,
    )
    return summary


def _read_stage(
    files: Sequence[Path],
    chunker: Chunker,
    corpus: Corpus | None,
    summary: IngestSummary,
    notify: ProgressCallback,
    skip_unreadable: bool = False,
) -> list[_FilePlan]:
    t0 = time.perf_counter()
    plans: list[_FilePlan] = []
    problems: list[IngestError] = []
    notify("read", 0, len(files))
    for done, path in enumerate(files, start=1):
        try:
            plan = _read_plan(path, chunker, corpus)
        except IngestError as exc:
            if not skip_unreadable:
                raise
            problems.append(exc)
            why = str(exc).removeprefix(str(path)).lstrip(":").strip()  # the path has its own column
            summary.skipped.append((str(path), why))
            log.info("skipped %s", exc)
        else:
            if plan is None:
                summary.files_unchanged += 1
            else:
                plans.append(plan)
        notify("read", done, len(files))
    if problems and len(problems) == len(files):
        first = problems[0]
        raise IngestError(
            str(first) if len(files) == 1 else f"none of the {len(files)} files can be read: {first}"
        )
    summary.files_changed = len(plans)
    summary.stage_seconds["read"] = time.perf_counter() - t0
    return plans


def _read_plan(path: Path, chunker: Chunker, corpus: Corpus | None) -> _FilePlan | None:
    """A file read and chunked, or None when the corpus holds it unchanged; IngestError if unreadable."""
    data = read_bytes(path)
    content_hash = hashlib.sha256(data).hexdigest()
    if corpus is not None and corpus.db.file_hash(str(path)) == content_hash:
        return None
    docs = read_file(path, data)
    stat = path.stat()
    return _FilePlan(
        path, content_hash, stat.st_size, stat.st_mtime, [(d, chunker.split(d.text)) for d in docs]
    )


def _embed_stage(
    plans: Sequence[_FilePlan], corpus: Corpus, summary: IngestSummary, notify: ProgressCallback
) -> list[str]:
    """Embed new chunks and commit file by file; returns the KV keys of chunks that were dropped."""
    t0 = time.perf_counter()
    unique = list(dict.fromkeys(c.chunk_id for p in plans for _, cs in p.documents for c in cs))
    total = len(unique) - len(corpus.db.known_chunk_ids(unique))
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        notify("embed", done, total)

    notify("embed", 0, total)
    removed_kv: list[str] = []
    for plan in plans:
        changes = corpus.add_documents(
            plan.documents, (str(plan.path), plan.content_hash, plan.size, plan.mtime), on_embedded=advance
        )
        summary.documents += len(plan.documents)
        summary.chunks += changes.chunks
        summary.tokens += changes.tokens
        summary.new_chunks += len(changes.new_chunks)
        summary.removed_chunks += len(changes.removed_chunks)
        removed_kv.extend(changes.removed_kv_keys)
    summary.stage_seconds["embed"] = time.perf_counter() - t0
    return removed_kv


def _index_stage(
    corpus: Corpus, index_changed: bool, summary: IngestSummary, notify: ProgressCallback
) -> None:
    t0 = time.perf_counter()
    notify("index", 0, 1)
    if index_changed:
        corpus.rebuild_index()
    else:
        corpus.save_index()
    notify("index", 1, 1)
    summary.stage_seconds["index"] = time.perf_counter() - t0


def _prune_stage(
    corpus: Corpus,
    paths: Sequence[str | Path],
    files: Sequence[Path],
    engine: ChunkKVWriter | None,
    summary: IngestSummary,
) -> None:
    """Forget the files recorded under a folder being ingested that are no longer in it."""
    roots = [Path(p).expanduser().resolve() for p in paths if Path(p).expanduser().is_dir()]
    present = {str(f) for f in files}
    gone = [
        recorded
        for recorded in corpus.db.file_paths()
        if recorded not in present and any(Path(recorded).is_relative_to(root) for root in roots)
    ]
    if gone:
        changes = corpus.documents.delete_files(gone)
        summary.removed_files += len(gone)
        summary.removed_chunks += len(changes.removed_chunks)
        log.info(
            "forgot %d files gone from the ingested folders (%d chunks)",
            len(gone),
            len(changes.removed_chunks),
        )


def _kv_stage(
    corpus: Corpus,
    model_path: Path,
    engine: ChunkKVWriter | None,
    removed_kv: Sequence[str],
    summary: IngestSummary,
    notify: ProgressCallback,
    config: Config,
) -> None:
    t0 = time.perf_counter()
    pending = len(corpus.db.pending_kv())
    notify("kv", 0, pending)
    owned = None
    if pending and engine is None:
        loading = time.perf_counter()
        engine = owned = create_engine(
            "torch",
            model=model_path,
            store=corpus.kv_store,
            chunk_context=corpus.chunk_context,
            config=config,
        )
        loaded = time.perf_counter() - loading
        summary.stage_seconds["load"] += loaded
        t0 += loaded
    try:
        if engine is not None:
            computed, written = precompute_pending(
                corpus, engine, lambda done, total: notify("kv", done, total)
            )
            summary.kv_chunks += computed
            summary.kv_bytes += written
        # the KV of chunks the corpus no longer holds (their keys hash token ids no chunk has now)
        corpus.documents.drop_kv(removed_kv)
        if corpus.kv_store.remote is not None:
            summary.kv_remote_pinned = pin_corpus(corpus, corpus.kv_store)
    finally:
        if owned is not None:
            owned.close()
    summary.stage_seconds["kv"] = time.perf_counter() - t0
