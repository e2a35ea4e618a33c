"""Exact KV of prompt openings, kept on disk beside a store's chunk KV.

A chat template's opening (system prompt, "Passages:") is the same bytes in every prompt, and a method
that reuses chunks reuses its KV as the prompt's own exact prefix (``Engine.exact_head``). Stored in the
store's chunk codec (int8 by default) it would no longer be exact, so it is kept here in the float codec
of the dtype it was computed in (lossless): one file per opening, ``ROOT/exact/ab/<key>.safetensors``, in
the chunk file format (every layer checked when read). The key is made like a chunk's (model fingerprint,
codec, layout, token ids) with the device kind the KV was computed on, so it is read back only where a
full prefill would compute the same numbers.

Few and small (a few tens of tokens each), the files are bounded by count and bytes, the least recently
read removed first; an opening longer than ``MAX_EXACT_TOKENS`` (a chat's own history before the passages,
seldom seen twice) is not stored. Their absence only costs a recompute.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..blend.segments import ChunkKV
from ..errors import StoreError
from ..models.runtime import ModelShape
from .codec import get_codec
from .disk import FILE_SUFFIX, TEMP_SUFFIX, make_dirs
from .fileformat import InvalidKVFile, check_model, decode, encode
from .keys import chunk_key

log = logging.getLogger(__name__)

EXACT_DIR = "exact"
MAX_EXACT_FILES = 64
MAX_EXACT_TOKENS = 512
MAX_EXACT_BYTES = 256 * 2**20
STALE_TEMP_S = 3600.0  # a temporary file this old has no writer left


class ExactKVFiles:
    """Openings' exact KV under ``root`` (a store's root) for one model, computed in ``dtype`` on a
    ``device_type`` device. ``writable`` False: read only (a read-only store). Safe for several threads
    and processes: files are written to a temporary name and renamed."""

    def __init__(
        self,
        root: str | Path,
        fingerprint: str,
        shape: ModelShape,
        dtype: torch.dtype,
        device_type: str,
        writable: bool = True,
        max_files: int = MAX_EXACT_FILES,
        max_bytes: int = MAX_EXACT_BYTES,
        max_tokens: int = MAX_EXACT_TOKENS,
    ) -> None:
        self.dir = Path(root) / EXACT_DIR
        self.fingerprint = fingerprint
        self.shape = shape
        self.codec = get_codec(dtype)  # a float codec: the computed tensors as they are
        self.device_type = device_type
        self.writable = writable
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.max_tokens = max_tokens

    def key(self, token_ids: Sequence[int]) -> str:
        """The opening's key: a chunk key in this codec, its context naming what made the KV."""
        return chunk_key(self.fingerprint, self.codec.name, token_ids, f"exact-prefix@{self.device_type}")

    def path_for(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}{FILE_SUFFIX}"

    def get(self, token_ids: Sequence[int]) -> ChunkKV | None:
        """The opening's KV (on the CPU, in the computed dtype), or None when absent or unusable (a bad
        file is logged and removed)."""
        if len(token_ids) > self.max_tokens:
            return None
        key = self.key(token_ids)
        path = self.path_for(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("exact prefix KV %s… unreadable: %s", key[:16], exc)
            return None
        try:
            meta, kv = decode(data, key)
            check_model(meta, self.fingerprint, self.codec.name, self.shape)
            if meta.num_tokens != len(token_ids):
                raise InvalidKVFile(f"{meta.num_tokens} tokens, not {len(token_ids)}")
        except InvalidKVFile as exc:
            log.warning("exact prefix KV %s… is unusable (%s); removed", key[:16], exc)
            self._remove(path)
            return None
        self._touch(path)
        return kv

    def put(self, token_ids: Sequence[int], kv: ChunkKV) -> None:
        """Keep the opening's KV (any device; stored as it is). A failure to write (read-only, disk full)
        is logged: it costs a recompute next time, never an answer."""
        if not self.writable or len(token_ids) > self.max_tokens:
            return
        key = self.key(token_ids)
        cpu = ChunkKV([k.cpu() for k in kv.keys], [v.cpu() for v in kv.values], kv.fingerprint)
        try:
            data = encode(key, cpu, self.fingerprint, self.shape, self.codec).data()
            _write_atomically(self.path_for(key), data)
            self._prune(keep=key)
        except (OSError, StoreError) as exc:
            log.warning("exact prefix KV %s… was computed but not stored: %s", key[:16], exc)

    def _files(self) -> list[Path]:
        return _files_in(self.dir)

    def _prune(self, keep: str) -> None:
        """Drop the least recently read files beyond the count and byte bounds, and temporary files a
        killed writer left."""
        stale = time.time() - STALE_TEMP_S
        for temp in self.dir.glob(f"??/.*{TEMP_SUFFIX}"):
            with contextlib.suppress(OSError):  # another writer's, just renamed or removed
                if temp.stat().st_mtime < stale:
                    temp.unlink()
        entries = []
        for path in self._files():
            try:
                stat = path.stat()
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            entries.append((stat.st_mtime_ns, stat.st_size, path))
        entries.sort()
        count, total = len(entries), sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if count <= self.max_files and total <= self.max_bytes:
                break
            if path.name.startswith(keep):
                continue
            self._remove(path)
            count, total = count - 1, total - size

    @staticmethod
    def _touch(path: Path) -> None:
        # the file's mtime orders pruning, least recently read first (a read-only store prunes nothing)
        with contextlib.suppress(OSError):
            os.utime(path)

    @staticmethod
    def _remove(path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not remove exact prefix KV %s: %s", path.name, exc)


def clear_exact_files(root: str | Path) -> int:
    """Remove every opening's file under the store root ``root``; returns how many."""
    files = _files_in(Path(root) / EXACT_DIR)
    for path in files:
        ExactKVFiles._remove(path)
    return len(files)


def _files_in(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"??/*{FILE_SUFFIX}"))


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary name beside ``path`` and rename it: readers see all or nothing."""
    make_dirs(path.parent)
    temp = path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    try:
        temp.write_bytes(data)
        temp.chmod(0o644)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
