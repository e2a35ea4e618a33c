"""What a corpus directory was built with (``manifest.json``) and the checks that keep work on a corpus
consistent with it: the same model, embedder (name and dimension) and chunk size."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import StoreError
from ..store.codec import get_codec
from ..store.index import folder_codec
from .embedder import same_embedder

if TYPE_CHECKING:
    from ..models.tokenizer import ModelTokenizer
    from .embedder import EmbedderLike

log = logging.getLogger(__name__)

# 2: chunk KV is precomputed behind the chunk context the manifest records (part of each KV key).
# A format-1 corpus (chunks prefilled alone) is read as having no context, and upgraded by ingest.
FORMAT_VERSION = 2
# 3: format 2 with quantized chunk KV (kv_dtype int8/int4): a build from before codecs refuses such a
# corpus rather than serving it in float16. Written only for quantized codecs, so a float16 corpus stays
# readable by older builds.
QUANTIZED_FORMAT_VERSION = 3
READABLE_FORMATS = (1, 2, 3)
MANIFEST_NAME = "manifest.json"
KV_DIR_NAME = "kv"


@dataclass(frozen=True)
class CorpusManifest:
    """What a corpus directory was built with; it only accepts work from the same model and embedder."""

    model: str
    model_path: str
    model_fingerprint: str
    embedder: str
    embedding_dim: int
    chunk_tokens: int
    index_type: str
    format_version: int = FORMAT_VERSION
    created_at: float = field(default_factory=time.time)
    # token ids chunks are prefilled behind when their KV is precomputed (empty: alone)
    chunk_context: tuple[int, ...] = ()
    # the codec its chunk KV is stored in (part of every KV key; ``store recode`` changes it); '': made
    # before codecs were recorded, stored in whatever the kv_dtype setting says
    kv_dtype: str = ""
    # SHA-256 of the embedder's weights (corpus/embedder.py: weights_sha256): with it the embedder is
    # recognised by its weights wherever its folder is; '': a model known by name only, or a corpus made
    # before embedders were recorded by identity (then by name, or by the path it recorded)
    embedder_sha256: str = ""

    @classmethod
    def new(
        cls,
        model: ModelTokenizer,
        embedder: EmbedderLike,
        embedder_sha256: str,
        chunk_tokens: int,
        index_type: str,
        chunk_context: tuple[int, ...],
        kv_dtype: str,
    ) -> CorpusManifest:
        """The manifest of a corpus created now with these settings."""
        return cls(
            model=model.name,
            model_path=str(model.path),
            model_fingerprint=model.fingerprint,
            embedder=embedder.name,
            embedding_dim=embedder.dim,
            embedder_sha256=embedder_sha256,
            chunk_tokens=chunk_tokens,
            index_type=index_type,
            chunk_context=chunk_context,
            kv_dtype=kv_dtype,
            format_version=format_for(kv_dtype),
        )

    @classmethod
    def load(cls, corpus_dir: Path) -> CorpusManifest | None:
        """The manifest of ``corpus_dir``, or None when the folder holds none."""
        path = Path(corpus_dir) / MANIFEST_NAME
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            if raw.get("format_version") not in READABLE_FORMATS:
                raise StoreError(
                    f"{path}: corpus format {raw.get('format_version')!r} is not supported "
                    f"(this version reads formats {', '.join(map(str, READABLE_FORMATS))}); "
                    "rebuild the corpus"
                )
            fields = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
            fields["chunk_context"] = tuple(int(t) for t in fields.get("chunk_context", ()))
            return cls(**fields)
        except (ValueError, TypeError, KeyError) as exc:
            raise StoreError(f"{path}: unreadable manifest: {exc}") from exc

    def save(self, corpus_dir: Path) -> None:
        path = Path(corpus_dir) / MANIFEST_NAME
        tmp = path.with_name(f".{MANIFEST_NAME}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")
        tmp.chmod(0o644)  # never world-writable, whatever the umask
        os.replace(tmp, path)


def format_for(kv_dtype: str, current: int = FORMAT_VERSION) -> int:
    """The format a corpus of format ``current`` (1 is upgraded first, and stays 1) records for codec
    ``kv_dtype``: 3 for a quantized codec, else 2."""
    if current < FORMAT_VERSION:
        return current
    quantized = bool(kv_dtype) and get_codec(kv_dtype).quantized
    return QUANTIZED_FORMAT_VERSION if quantized else FORMAT_VERSION


def legacy_codec(kv_dir: Path, manifest: CorpusManifest, configured: str) -> str:
    """The codec of a corpus whose manifest records none (made before codecs were recorded): the one its
    KV store at ``kv_dir`` holds (``configured`` if it holds several), else ``configured``, the codec
    its first chunk KV will be written in. Its KV is never re-read in a codec it was not written in."""
    return folder_codec(kv_dir, manifest.model_fingerprint, None, get_codec(configured).name)


def check_new_corpus_dir(corpus_dir: Path) -> None:
    """Refuse to turn a file, or a folder holding anything but hidden files and a KV store, into a store."""
    if corpus_dir.exists() and (
        not corpus_dir.is_dir()
        or any(not p.name.startswith(".") and p.name != KV_DIR_NAME for p in corpus_dir.iterdir())
    ):
        raise StoreError(
            f"{corpus_dir} exists and is neither an empty folder nor a cacheblend-rag store "
            "(a corpus directory)"
        )


def narrow_corpus_dir(corpus_dir: Path, mode: int) -> None:
    """Give a folder becoming a corpus the corpus's ``mode`` at most: it may already exist, made by a KV
    store opened under it first (``Engine(store=DIR / "kv")``, whose folders are 0755), and mkdir leaves
    an existing folder's mode as it is. Only ever narrows; a folder of another owner is left as it is."""
    try:
        current = stat.S_IMODE(corpus_dir.stat().st_mode)
        if current & ~mode:
            corpus_dir.chmod(current & mode)
    except OSError as exc:
        log.debug("cannot narrow the mode of %s: %s", corpus_dir, exc)


def check_compatible(
    corpus_dir: Path,
    manifest: CorpusManifest,
    model: ModelTokenizer,
    embedder: EmbedderLike | None,
    chunk_tokens: int | None,
) -> None:
    """Raise StoreError unless ``model`` (and the embedder and chunk size, when given) match the store's."""
    if model.fingerprint != manifest.model_fingerprint:
        raise StoreError(
            f"corpus {corpus_dir} was built with model {manifest.model} (fingerprint "
            f"{manifest.model_fingerprint[:12]}…, at {manifest.model_path}); this run uses {model.name} "
            f"({model.fingerprint[:12]}…, at {model.path}). Use the same model or another corpus directory."
        )
    if embedder is not None:
        check_embedder(corpus_dir, manifest, embedder)
    if chunk_tokens is not None and chunk_tokens != manifest.chunk_tokens:
        raise StoreError(
            f"corpus {corpus_dir} was built with {manifest.chunk_tokens}-token chunks, not {chunk_tokens}; "
            "use the same chunk size or another corpus directory"
        )


def check_embedder(corpus_dir: Path, manifest: CorpusManifest, embedder: EmbedderLike) -> None:
    """Raise StoreError unless ``embedder`` is the one the corpus's vectors came from (the same weights,
    or without a digest the same name; the same dimension)."""
    if not same_embedder(manifest.embedder, manifest.embedder_sha256, embedder):
        weights = f", weights sha256 {manifest.embedder_sha256[:12]}…" if manifest.embedder_sha256 else ""
        raise StoreError(
            f"corpus {corpus_dir} was built with embedder {manifest.embedder} "
            f"({manifest.embedding_dim}-dim vectors{weights}), not {embedder.name}; give the same embedder "
            "again or use another corpus directory"
        )
    if embedder.dim != manifest.embedding_dim:
        raise StoreError(
            f"embedder {embedder.name} gives {embedder.dim}-dim vectors, corpus {corpus_dir} holds "
            f"{manifest.embedding_dim}-dim ones; give the embedder the corpus was built with"
        )
