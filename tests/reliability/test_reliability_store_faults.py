"""Faults in the KV store of a real ingested store, end to end: every fault is reported by ``store verify``
(which changes nothing without ``--repair``), detected and logged by a query, recomputed or refused with a
clear message, and every answer equals the fault-free run's."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sqlite3
import struct
import subprocess
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from reliability_support import (
    CHUNK_TOKENS,
    answer,
    invoke_cli,
    kv_files,
    kv_path,
    store_verify,
    temp_files,
)

from cacheblend_rag.blend.segments import ChunkKV
from cacheblend_rag.corpus.chunkdb import DB_NAME
from cacheblend_rag.errors import StoreError
from cacheblend_rag.ingest.pipeline import ingest
from cacheblend_rag.store.kvstore import KV_INDEX_NAME, KVStore

OTHER_FINGERPRINT = "0" * 64  # no real model hashes to this


# -- fault injectors: each damages the entry of ``key`` in the store at ``root`` ---------------------------


def _flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def flip_tensor_bit(root: Path, key: str) -> None:
    path = kv_path(root, key)
    _flip_bit(path, path.stat().st_size * 2 // 3)  # tensor bytes: the header is a few KiB of megabytes


def flip_header_bit(root: Path, key: str) -> None:
    path = kv_path(root, key)
    (header_len,) = struct.unpack("<Q", path.read_bytes()[:8])
    _flip_bit(path, 8 + header_len // 2)


def truncate(root: Path, key: str) -> None:
    path = kv_path(root, key)
    os.truncate(path, path.stat().st_size // 2)


def zero_length(root: Path, key: str) -> None:
    os.truncate(kv_path(root, key), 0)


def _rewrite_as(root: Path, key: str, fingerprint: str | None, kv_dtype: str) -> None:
    """Replace ``key``'s file by a valid, self-consistent file of the same chunk written by a store of
    another model (fingerprint) or storage dtype."""
    with KVStore.open_existing(root / "kv") as ours:
        source = ours.get(key)
        layers = [source.layer(i) for i in range(source.num_layers)]
        shape, fingerprint = ours.shape, fingerprint or ours.fingerprint
    other_root = root.parent / f"other-{fingerprint[:4]}-{kv_dtype}"
    with KVStore(other_root, fingerprint, shape, kv_dtype) as theirs:
        theirs.put(key, ChunkKV([k for k, _ in layers], [v for _, v in layers], fingerprint))
        shutil.copyfile(theirs.path_for(key), kv_path(root, key))


def foreign_model(root: Path, key: str) -> None:
    _rewrite_as(root, key, OTHER_FINGERPRINT, "float16")


def foreign_dtype(root: Path, key: str) -> None:
    _rewrite_as(root, key, None, "bfloat16")


def swapped_file(root: Path, key: str) -> None:
    other = next(p for p in kv_files(root) if not p.name.startswith(key))
    shutil.copyfile(other, kv_path(root, key))


def drop_index_row(root: Path, key: str) -> None:
    with sqlite3.connect(root / "kv" / KV_INDEX_NAME) as db:
        assert db.execute("DELETE FROM chunks WHERE key = ?", (key,)).rowcount == 1


def delete_file(root: Path, key: str) -> None:
    kv_path(root, key).unlink()


@dataclass(frozen=True)
class Fault:
    name: str
    inject: Callable[[Path, str], None]
    verify_finds: str  # the VerifyReport list that must name the key
    log: str | None  # what the query must log (with the key), None where the fault is a plain miss/adopt
    handling: str


FAULTS = [
    Fault(
        "bit flip in a layer's tensor bytes",
        flip_tensor_bit,
        "corrupt",
        "is corrupt",  # the engine's retry after the layer failed its crc mid-fusion
        "layer crc fails mid-fusion: removed, recomputed, fusion retried",
    ),
    Fault(
        "bit flip in the safetensors header",
        flip_header_bit,
        "corrupt",
        "unusable",
        "unreadable header or metadata crc: logged miss, recomputed",
    ),
    Fault(
        "file truncated to half",
        truncate,
        "corrupt",
        "unusable",
        "unreadable file: logged miss, recomputed, rewritten",
    ),
    Fault(
        "zero-length file", zero_length, "corrupt", "zero-length file", "logged miss, recomputed, rewritten"
    ),
    Fault(
        "file written for another model/tokenizer",
        foreign_model,
        "orphan_files",
        "foreign file of model",
        "fingerprint differs: never used, recomputed, rewritten",
    ),
    Fault(
        "file written in another dtype (bf16)",
        foreign_dtype,
        "orphan_files",
        "foreign file in bfloat16",
        "dtype differs: never used, recomputed, rewritten",
    ),
    Fault(
        "another chunk's file under this key",
        swapped_file,
        "corrupt",
        "not the key it is stored under",
        "key in metadata differs: never used, recomputed",
    ),
    Fault(
        "index row missing (file present)",
        drop_index_row,
        "orphan_files",
        None,
        "file checked and served, row re-created",
    ),
    Fault(
        "index row without its file",
        delete_file,
        "missing_files",
        None,
        "plain miss: recomputed and written back",
    ),
]


def _verify_names(report: dict, category: str, key: str) -> bool:
    entries = report.get(category, [])
    return any((e["key"] if isinstance(e, dict) else e) == key for e in entries)


def _snapshot(root: Path, access_times: bool = True) -> dict[str, object]:
    """What the KV store holds: every file under kv/chunks byte for byte, and the index rows (without
    last-access times unless ``access_times``)."""
    files: dict[str, object] = {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted((root / "kv" / "chunks").rglob("*"))
        if p.is_file()
    }
    columns = "*" if access_times else "key, model_fingerprint, kv_dtype, num_tokens, size_bytes, checksum"
    # a read-only folder cannot hold the -shm file of a plain read-only open (nobody writes there anyway)
    mode = "ro" if os.access(root / "kv", os.W_OK) else "ro&immutable=1"
    with closing(sqlite3.connect(f"file:{root / 'kv' / KV_INDEX_NAME}?mode={mode}", uri=True)) as db:
        files["index rows"] = db.execute(f"SELECT {columns} FROM chunks ORDER BY key").fetchall()
    return files


@pytest.mark.parametrize("fault", FAULTS, ids=[f.inject.__name__ for f in FAULTS])
def test_fault_is_reported_detected_and_the_answer_unchanged(
    fault, store_copy, rag_on, reference, rel_questions, faults, caplog
):
    question = rel_questions[FAULTS.index(fault) % len(rel_questions)]
    want = reference.answers([(question, "cacheblend")])
    key = reference.kv_keys(question)[0]
    root = store_copy()
    fault.inject(root, key)

    before = _snapshot(root)
    code, report = store_verify(root)
    assert code == 1 and _verify_names(report, fault.verify_finds, key), report
    assert _snapshot(root) == before  # verify without --repair reports and changes nothing

    caplog.set_level(logging.WARNING, logger="cacheblend_rag")
    with rag_on(root) as rag:
        got = {(question, "cacheblend"): answer(rag, question)}
    if fault.log is not None:
        logged = [r.getMessage() for r in caplog.records if key[:16] in r.getMessage()]
        assert any(fault.log in message for message in logged), caplog.text

    assert not faults.record("store", fault.name, fault.handling, got, want)
    code, report = store_verify(root)
    assert code == 0 and report["clean"] and report["ok"] == len(kv_files(root)), report


def test_verify_repair_fixes_every_fault_at_once(store_copy, rag_on, reference, rel_questions, faults):
    cases = [(q, "cacheblend") for q in rel_questions]
    want = reference.answers(cases)
    root = store_copy()
    keys = [p.name.removesuffix(".safetensors") for p in kv_files(root)]
    applied = [f for f in FAULTS if f.inject is not swapped_file][: len(keys)]  # one chunk per fault
    for fault, key in zip(applied, keys, strict=False):
        fault.inject(root, key)

    code, report = store_verify(root)
    assert code == 1 and not report["clean"]
    for fault, key in zip(applied, keys, strict=False):
        assert _verify_names(report, fault.verify_finds, key), (fault.name, report)
    code, repaired = store_verify(root, repair=True)
    assert code == 0 and repaired["repaired"]
    code, report = store_verify(root)
    assert code == 0 and report["clean"], report

    with rag_on(root) as rag:
        got = {case: answer(rag, *case) for case in cases}
    handling = f"{len(applied)} faults on {len(applied)} chunks: verify --repair then queries recompute"
    assert not faults.record("store", "all of the above at once, verify --repair", handling, got, want)
    assert store_verify(root)[0] == 0


# -- read-only store -----------------------------------------------------------------------------------


@pytest.fixture
def make_read_only(tmp_path) -> Iterator[Callable[[Path], Path]]:
    """``make_read_only(store) -> Path``: the store on a read-only file system (a tmpfs remounted
    read-only; root ignores permission bits) or, for other users, with every write permission removed."""
    mounted: list[Path] = []
    chmodded: list[Path] = []

    def make(store: Path) -> Path:
        if os.geteuid() != 0:
            for path in [store, *store.rglob("*")]:
                path.chmod(path.stat().st_mode & ~0o222)
            chmodded.append(store)
            return store
        point = tmp_path / "ro-mount"
        point.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(point)]).returncode:
            pytest.skip("root can make a store read-only only on a read-only mount, and mount failed")
        mounted.append(point)
        shutil.copytree(store, point / "store", symlinks=True)
        subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)
        return point / "store"

    yield make
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)
    for store in chmodded:
        for path in [store, *store.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)


def test_read_only_store_answers_and_refuses_writes_clearly(
    store_copy, make_read_only, rag_on, reference, rel_questions, rel_docs, faults, caplog, tmp_path
):
    cases = [
        (rel_questions[0], "cacheblend"),
        (rel_questions[1], "cacheblend"),
        (rel_questions[1], "full_reuse"),
    ]
    want = reference.answers(cases)
    root = store_copy()
    missing = reference.kv_keys(rel_questions[0])[0]
    with KVStore.open_existing(root / "kv") as kv:
        kv.delete(missing)  # this query must compute the chunk and cannot write it back
    root = make_read_only(root)
    before = _snapshot(root)

    caplog.set_level(logging.WARNING, logger="cacheblend_rag")
    with rag_on(root) as rag:
        assert rag.engine.store.read_only and rag.corpus.db.readonly
        got = {case: answer(rag, *case) for case in cases}
    assert any(missing[:16] in r.getMessage() and "read-only" in r.getMessage() for r in caplog.records)
    assert _snapshot(root) == before

    code, report = store_verify(root)
    assert code == 0 and report["clean"], report
    refused = invoke_cli("store", "verify", "--corpus", root, "--repair")
    assert refused.exit_code == 1 and "read-only" in refused.output
    refused = invoke_cli("store", "gc", "--corpus", root)
    assert refused.exit_code == 1 and "read-only" in refused.output
    extra = tmp_path / "extra.txt"
    extra.write_text("A new document that a read-only store cannot take in.\n")
    with pytest.raises(
        StoreError, match=r"cannot write to store .*: Read-only file system|Permission denied"
    ):
        ingest([extra], root, chunk_tokens=CHUNK_TOKENS, precompute_kv=False)
    assert _snapshot(root) == before
    handling = "reads served; write-back skipped with a warning; repair/gc/ingest refused"
    assert not faults.record("store", "read-only store directory", handling, got, want)


# -- full disk -----------------------------------------------------------------------------------------


@contextmanager
def disk_full(monkeypatch, root: Path, at: str, free: int = 64 * 1024) -> Iterator[None]:
    """Make the file system under ``root`` full: ``os.write`` to a file under it succeeds for ``free`` bytes
    then fails with ENOSPC (``at="write"``), or ``os.fsync`` of it fails with ENOSPC, as on file systems
    that allocate late (``at="fsync"``). Files elsewhere are not affected."""
    root = root.resolve()
    real_write, real_fsync = os.write, os.fsync
    left = [free]

    def under_root(fd: int) -> bool:
        try:
            return Path(os.readlink(f"/proc/self/fd/{fd}")).is_relative_to(root)
        except OSError:
            return False

    def write(fd, data):
        if at == "write" and under_root(fd):
            if left[0] <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            data = memoryview(data)[: left[0]]
            left[0] -= len(data)
        return real_write(fd, data)

    def fsync(fd):
        if at == "fsync" and under_root(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    with monkeypatch.context() as patch:
        patch.setattr(os, "write", write)
        patch.setattr(os, "fsync", fsync)
        yield


@pytest.mark.parametrize("at", ["write", "fsync"])
def test_full_disk_during_query_write_back(
    at, store_copy, rag_on, reference, rel_questions, faults, caplog, monkeypatch
):
    question = rel_questions[2]
    case = (question, "cacheblend")
    want = reference.answers([case])
    root = store_copy()
    missing = reference.kv_keys(question)[0]
    with KVStore.open_existing(root / "kv") as kv:
        kv.delete(missing)
    before = _snapshot(root, access_times=False)

    caplog.set_level(logging.WARNING, logger="cacheblend_rag")
    with disk_full(monkeypatch, root, at), rag_on(root) as rag:
        got = {case: answer(rag, question)}
    assert any(missing[:16] in r.getMessage() and "disk full" in r.getMessage() for r in caplog.records)
    assert not temp_files(root) and not kv_path(root, missing).exists()
    assert _snapshot(root, access_times=False) == before

    with rag_on(root) as rag:  # space freed: the next query stores the chunk
        got[question, "cacheblend (space freed)"] = answer(rag, question)
    want[question, "cacheblend (space freed)"] = want[case]
    assert kv_path(root, missing).exists() and store_verify(root)[0] == 0
    handling = "answer served; write-back refused (disk full) and logged; no temp file left"
    assert not faults.record("store", f"disk full (ENOSPC at {at}) during write-back", handling, got, want)


def test_full_disk_during_ingest_stops_cleanly_and_resumes(
    store_copy, rag_on, reference, rel_questions, rel_docs, model, faults, monkeypatch
):
    from cacheblend_rag.engine import Engine

    cases = [(q, "cacheblend") for q in rel_questions[:2]]
    want = reference.answers(cases)
    root = store_copy()
    pending = {reference.kv_keys(q)[0] for q, _ in cases}
    with KVStore.open_existing(root / "kv") as kv:
        for key in pending:
            kv.delete(key)
    with sqlite3.connect(root / DB_NAME) as db:  # as if an earlier ingest stopped before these chunks' KV
        marks = ",".join("?" * len(pending))
        db.execute(f"UPDATE chunks SET kv_ready = 0 WHERE kv_key IN ({marks})", list(pending))

    engine = Engine(model=model, store=root / "kv")
    try:
        with disk_full(monkeypatch, root, "write"), pytest.raises(StoreError, match="disk full"):
            ingest([rel_docs], root, engine=engine)
        assert not temp_files(root) and store_verify(root)[0] == 0
        assert not any(kv_path(root, key).exists() for key in pending)
        resumed = ingest([rel_docs], root, engine=engine)
    finally:
        engine.store.close()
    assert (resumed.files_changed, resumed.kv_chunks) == (0, len(pending))
    with rag_on(root) as rag:
        got = {case: answer(rag, *case) for case in cases}
        assert rag.corpus.stats().kv_ready == rag.corpus.stats().chunks
    handling = "ingest stops with 'disk full', nothing half-written; rerun resumes"
    assert not faults.record("store", "disk full (ENOSPC) during ingest's KV stage", handling, got, want)


def test_real_full_file_system_during_query_write_back(
    store_copy, rag_on, reference, rel_questions, faults, caplog, tmp_path
):
    """The same as the injected fault, on a real tmpfs filled up (needs root to mount)."""
    question = rel_questions[1]
    case = (question, "cacheblend")
    want = reference.answers([case])
    root = store_copy()
    missing = reference.kv_keys(question)[0]
    with KVStore.open_existing(root / "kv") as kv:
        kv.delete(missing)
    point = tmp_path / "full"
    point.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(point)]).returncode
    ):
        pytest.skip("mounting a tmpfs needs root; the injected ENOSPC tests cover this fault")
    try:
        shutil.copytree(root, point / "store")
        root = point / "store"
        with open(point / "filler", "wb") as filler:  # take every free byte but 256 KiB
            free = os.statvfs(point).f_bavail * os.statvfs(point).f_frsize
            filler.write(b"\0" * max(0, free - 256 * 1024))
        caplog.set_level(logging.WARNING, logger="cacheblend_rag")
        with rag_on(root) as rag:
            got = {case: answer(rag, question)}
        assert any(missing[:16] in r.getMessage() and "disk full" in r.getMessage() for r in caplog.records)
        assert not temp_files(root) and not kv_path(root, missing).exists()
        (point / "filler").unlink()
        assert store_verify(root)[0] == 0
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)
    handling = "answer served; write-back refused (disk full) and logged"
    assert not faults.record("store", "real full tmpfs during write-back", handling, got, want)
