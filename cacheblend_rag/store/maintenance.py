"""Maintenance of the disk tier: verify every file against its checksums and the index, and collect
garbage (reconcile index and files, drop killed writers' leftovers, enforce the budget)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .disk import DiskTier
from .fileformat import InvalidKVFile, open_file, read_parts


@dataclass
class VerifyReport:
    """What :meth:`KVStore.verify` found (and, with ``repair``, fixed)."""

    checked: int = 0
    ok: int = 0
    corrupt: list[dict[str, str]] = field(default_factory=list)  # key + reason; removed on repair
    missing_files: list[str] = field(default_factory=list)  # index rows without a file; dropped on repair
    orphan_files: list[str] = field(default_factory=list)  # valid files without a row; indexed on repair
    stale_temp_files: list[str] = field(default_factory=list)  # killed writers' leftovers; removed on repair
    repaired: bool = False

    @property
    def clean(self) -> bool:
        return not (self.corrupt or self.missing_files or self.orphan_files or self.stale_temp_files)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "clean": self.clean}


def verify(disk: DiskTier, repair: bool = False) -> VerifyReport:
    """Read and check every file (metadata and every layer's checksum) and the index against the
    files. Files of other models are checked for self-consistency. With ``repair``, corrupt files and
    leftovers of killed writers are removed, rows without files dropped, valid files without rows
    indexed."""
    if repair:
        disk.require_writable("repair it")
    report = VerifyReport(repaired=repair)
    rows = disk.index.checksums()
    seen: set[str] = set()
    for path in disk.chunk_files():
        key = disk.key_of(path)
        report.checked += 1
        seen.add(key)
        try:
            handle, meta, stat = open_file(path, key)
            for layer in range(meta.num_layers):
                read_parts(handle, meta, layer)  # the crc covers the encoded bytes
        except FileNotFoundError:
            continue
        except InvalidKVFile as exc:
            report.corrupt.append({"key": key, "reason": str(exc)})
            if repair:
                disk.discard(key, str(exc), None)
            continue
        report.ok += 1
        if rows.get(key) != meta.checksum:
            report.orphan_files.append(key)
            if repair:
                disk.index.record(key, meta, stat.st_size)
    report.missing_files = sorted(set(rows) - seen)
    if repair:
        for key in report.missing_files:
            disk.index.forget(key)
    report.stale_temp_files = [str(p) for p in disk.stale_temp_files(remove=repair)]
    return report


def gc(disk: DiskTier) -> dict[str, int]:
    """Enforce the budget (LRU by last access) and reconcile the index with the files: drop rows
    without files, index valid files without rows, remove unreadable files and stale temp files."""
    disk.require_writable("collect garbage")
    report = {"rows_dropped": 0, "files_indexed": 0, "files_removed": 0, "temp_removed": 0, "evicted": 0}
    rows = set(disk.index.checksums())
    on_disk = set()
    for path in disk.chunk_files():
        key = disk.key_of(path)
        on_disk.add(key)
        if key in rows:
            continue
        try:
            _, meta, stat = open_file(path, key)
        except FileNotFoundError:
            continue
        except InvalidKVFile as exc:
            disk.discard(key, str(exc), None)
            report["files_removed"] += 1
            continue
        disk.index.record(key, meta, stat.st_size)
        report["files_indexed"] += 1
    for key in rows - on_disk:
        if not disk.path_for(key).exists():  # not written meanwhile by another process
            disk.index.forget(key)
            report["rows_dropped"] += 1
    report["temp_removed"] = len(disk.stale_temp_files(remove=True))
    report["evicted"] = disk.enforce_budget()
    return report
