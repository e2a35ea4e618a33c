"""``cacheblend-rag serve`` as a child process on a free loopback port: for the load test and the tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 300.0  # loading the model on a busy machine


def free_port() -> int:
    """A port nothing listens on right now (the child binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``python -m cacheblend_rag serve --corpus CORPUS ARGS...`` on 127.0.0.1; its output goes to ``log``.

    ``env``: extra environment (settings such as ``CACHEBLEND_BATCH_MAX_REQUESTS``). :meth:`start` waits
    until ``/health`` answers; :meth:`stop` sends SIGTERM (the server drains, then exits) and waits.
    """

    def __init__(self, corpus: str | Path, log: str | Path, *args: str, env: dict[str, str] | None = None):
        self.corpus = Path(corpus)
        self.log = Path(log)
        self.args = [str(a) for a in args]
        self.env = {**os.environ, **(env or {})}
        self.port = 0
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The OpenAI base URL (``.../v1``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = START_TIMEOUT_S) -> ServerProcess:
        """:meth:`spawn`, then :meth:`wait_ready`."""
        return self.spawn().wait_ready(timeout)

    def spawn(self) -> ServerProcess:
        """Start the process on a free port, without waiting for it to answer."""
        self.port = free_port()
        argv = [sys.executable, "-m", "cacheblend_rag", "serve", "--corpus", str(self.corpus)]
        argv += ["--port", str(self.port), *self.args]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> ServerProcess:
        """Wait until ``/health`` answers; raises, with the end of the log, if the process exits first or
        does not answer within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"serve exited with {self.process.returncode}: {self.log_text()[-3000:]}")
            try:
                self.health()
                return self
            except (OSError, urllib.error.URLError):
                time.sleep(0.2)
        self.kill()
        raise TimeoutError(f"serve did not answer within {timeout:.0f} s: {self.log_text()[-3000:]}")

    def health(self) -> dict[str, Any]:
        """``GET /health`` (raises on a 503 or when nothing answers)."""
        with urllib.request.urlopen(f"{self.root}/health", timeout=10) as response:
            return json.loads(response.read())

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM, then wait for the exit (SIGKILL after ``timeout``); returns the exit status."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
