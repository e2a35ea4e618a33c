"""Child processes of the reliability suite's crash and concurrency tests.

``python children.py ingest STORE SYNC PATH... [--stall-write N]``: ingest PATHs into STORE (KV
precomputed) with an engine loaded up front; create SYNC/ready-PID and wait for SYNC/go first. With
``--stall-write N`` the N-th KV file write stops half way (bytes written and fsynced), creates
SYNC/stalled and hangs until the test kills the process. Prints the ingest summary as JSON, with
the wall-clock times it started and ended.

``python children.py query STORE SYNC QUESTION METHOD --stall {write,index}``: answer QUESTION on a store
whose chunk KV is partly missing, so that the query writes KV back; stop in that write, half way through
the file (``write``) or after the file is renamed into place but before the index knows it (``index``),
create SYNC/stalled and hang until killed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from cacheblend_rag.corpus.chunkdb import CorpusManifest
from cacheblend_rag.engine import Engine, SamplingParams
from cacheblend_rag.ingest.pipeline import ingest
from cacheblend_rag.rag import CacheBlendRAG
from cacheblend_rag.store import disk


def _stall(sync: Path) -> None:
    (sync / "stalled").touch()
    time.sleep(3600)


def _stall_mid_write(sync: Path, nth: int) -> None:
    real_write = disk._write_all
    writes = 0

    def write(fd: int, data: bytes) -> None:
        nonlocal writes
        writes += 1
        if writes < nth:
            real_write(fd, data)
            return
        real_write(fd, data[: len(data) // 2])
        os.fsync(fd)
        _stall(sync)

    disk._write_all = write


def _stall_before_index(sync: Path) -> None:
    # _fsync_dir runs right after the temp file is renamed into place and before the index row is written
    disk._fsync_dir = lambda directory: _stall(sync)


def _wait_for_go(sync: Path) -> None:
    (sync / f"ready-{os.getpid()}").touch()
    while not (sync / "go").exists():
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    run_ingest = commands.add_parser("ingest")
    run_ingest.add_argument("store", type=Path)
    run_ingest.add_argument("sync", type=Path)
    run_ingest.add_argument("paths", type=Path, nargs="+")
    run_ingest.add_argument("--chunk-tokens", type=int, default=None)
    run_ingest.add_argument("--stall-write", type=int, default=None)
    run_query = commands.add_parser("query")
    run_query.add_argument("store", type=Path)
    run_query.add_argument("sync", type=Path)
    run_query.add_argument("question")
    run_query.add_argument("method")
    run_query.add_argument("--top-k", type=int, required=True)
    run_query.add_argument("--stall", choices=("write", "index"), required=True)
    args = parser.parse_args()

    manifest = CorpusManifest.load(args.store)
    engine = Engine(model=manifest.model_path, store=args.store / "kv")
    if args.command == "ingest":
        if args.stall_write is not None:
            _stall_mid_write(args.sync, args.stall_write)
        _wait_for_go(args.sync)
        started = time.time()
        summary = ingest(args.paths, args.store, chunk_tokens=args.chunk_tokens, engine=engine)
        engine.store.close()
        print(json.dumps({**dataclasses.asdict(summary), "started": started, "ended": time.time()}))
    else:
        if args.stall == "write":
            _stall_mid_write(args.sync, 1)
        else:
            _stall_before_index(args.sync)
        rag = CacheBlendRAG(args.store, engine=engine)
        rag.query(args.question, top_k=args.top_k, method=args.method, sampling=SamplingParams(max_tokens=8))
        raise SystemExit("the query finished without writing any chunk KV back")


if __name__ == "__main__":
    main()
