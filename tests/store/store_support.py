"""Support for the store tests, loaded by path from conftest (tests run with --import-mode=importlib).

Run as a script it is the child side of the crash and concurrency tests:
``python store_support.py COMMAND ROOT SYNC_DIR ...`` (see :func:`main`).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import torch

from cacheblend_rag.blend.segments import ChunkKV
from cacheblend_rag.models.runtime import ModelShape
from cacheblend_rag.store import disk
from cacheblend_rag.store.kvstore import KVStore

FINGERPRINT = "a" * 64
OTHER_FINGERPRINT = "b" * 64

# The size of the default model, so that a write takes long enough for two writers to overlap.
BIG_SHAPE = ModelShape("llama", 30, 576, 9, 3, 64, 49152, 8192)


def big_chunk(n: int, seed: int) -> ChunkKV:
    generator = torch.Generator().manual_seed(seed)
    dims = (BIG_SHAPE.num_kv_heads, n, BIG_SHAPE.head_dim)
    keys = [torch.randn(dims, generator=generator) for _ in range(BIG_SHAPE.num_layers)]
    values = [torch.randn(dims, generator=generator) for _ in range(BIG_SHAPE.num_layers)]
    return ChunkKV(keys, values, FINGERPRINT)


def tensor_span(path: Path, name: str) -> tuple[int, int]:
    """Absolute byte range of tensor ``name`` inside a safetensors file."""
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    start, end = header[name]["data_offsets"]
    return 8 + header_len + start, 8 + header_len + end


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# -- child processes -----------------------------------------------------------------------------------


def start_child(command: str, root: Path, sync: Path, *args: object) -> subprocess.Popen:
    """Start ``python store_support.py command root sync args...``; its stdout is a pipe."""
    argv = [sys.executable, __file__, command, str(root), str(sync), *map(str, args)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def wait_for(path: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.01)


def release_when_ready(sync: Path, children: int) -> None:
    """Parent side of the start barrier: wait until every child is ready, then let them all go."""
    deadline = time.monotonic() + 120
    while len(list(sync.glob("ready-*"))) < children:
        if time.monotonic() > deadline:
            raise TimeoutError("children did not get ready")
        time.sleep(0.01)
    (sync / "go").touch()


def _ready_then_wait(sync: Path) -> None:
    (sync / f"ready-{os.getpid()}").touch()
    wait_for(sync / "go")


def _recode_and_stall(corpus: Path, sync: Path, codec: str, files: int) -> None:
    """Recode ``corpus`` to ``codec``; after ``files`` whole files, write half of the next one, create
    SYNC/stalled and hang until killed."""
    from cacheblend_rag.corpus.recode import recode_corpus

    written = []

    def stalling_write(fd: int, data: bytes) -> None:
        if len(written) < files:
            written.append(len(data))
            disk_write(fd, data)
            return
        os.write(fd, data[: len(data) // 2])
        os.fsync(fd)
        (sync / "stalled").touch()
        time.sleep(600)

    disk_write, disk._write_all = disk._write_all, stalling_write
    recode_corpus(corpus, codec, "float16")


def main(argv: list[str]) -> None:
    """put-same N: store the N-token chunk, print the bytes written. put-many FIRST COUNT: store COUNT
    chunks. put-and-stall N: write half of the file, create SYNC/halfway, then hang until killed.
    recode-and-stall CODEC FILES: recode the corpus ROOT, killed by the parent during file FILES + 1."""
    command, root, sync = argv[0], Path(argv[1]), Path(argv[2])
    if command == "recode-and-stall":
        _recode_and_stall(root, sync, argv[3], int(argv[4]))
        return
    store = KVStore(root, FINGERPRINT, BIG_SHAPE, "float16")  # exact round trips: a lossless codec
    if command == "put-same":
        n = int(argv[3])
        kv = big_chunk(n, seed=0)
        _ready_then_wait(sync)
        print(store.put(store.chunk_key(range(n)), kv))
    elif command == "put-many":
        first, count = int(argv[3]), int(argv[4])
        _ready_then_wait(sync)
        for i in range(first, first + count):
            store.put(store.chunk_key([i] * 64), big_chunk(64, seed=i))
    elif command == "put-and-stall":
        n = int(argv[3])

        def stalling_write(fd: int, data: bytes) -> None:
            os.write(fd, data[: len(data) // 2])
            os.fsync(fd)
            (sync / "halfway").touch()
            time.sleep(600)

        disk._write_all = stalling_write
        store.put(store.chunk_key(range(n)), big_chunk(n, seed=0))
    else:
        raise SystemExit(f"unknown command {command!r}")
    store.close()


if __name__ == "__main__":
    main(sys.argv[1:])
