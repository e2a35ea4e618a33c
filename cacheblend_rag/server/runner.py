"""Run the API under uvicorn, draining on SIGTERM.

On SIGTERM (or the first Ctrl-C) the server starts draining: it keeps its port open but answers new
requests with a 503 (``/health`` too), lets every request in flight finish, and exits once none is left or
``drain_timeout_s`` has passed; uvicorn then closes the connections and the app's shutdown finishes the
engine's queue and closes the stores. The exit status is 0 after a drain that finished. A second signal
exits at once.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn

from .app import ServeState

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 60.0


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose exit signals drain the requests in flight first (see the module doc)."""

    def __init__(self, config: uvicorn.Config, state: ServeState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self.drain_deadline: float | None = None
        self.drained = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # runs in the main thread, which is the event loop's: no lock needed with the middleware
        if self.state.draining:  # a second signal: stop now
            log.warning(
                "second %s: exiting without waiting for %d request(s)", _name(sig), self.state.in_flight
            )
            self.should_exit = self.force_exit = True
            return
        self.state.draining = True
        self.drain_deadline = time.monotonic() + self.drain_timeout_s
        log.warning(
            "%s: draining %d request(s) in flight (new requests get 503), then exiting",
            _name(sig),
            self.state.in_flight,
        )

    async def on_tick(self, counter: int) -> bool:
        if self.state.draining and self.drain_deadline is not None:
            if self.state.in_flight == 0:
                self.drained = True
                log.warning("drained: no request in flight; shutting down")
                return True
            if time.monotonic() > self.drain_deadline:
                log.error("drain timeout: %d request(s) still in flight are cut off", self.state.in_flight)
                return True
        return await super().on_tick(counter)


def _name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def serve_app(
    app,
    state: ServeState,
    host: str = "127.0.0.1",
    port: int = 8000,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    log_level: str = "info",
) -> bool:
    """Serve ``app`` until a signal; returns whether the drain finished (every request answered)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,  # after the drain only idle connections are left to close
        access_log=False,
    )
    server = DrainingServer(config, state, drain_timeout_s)
    server.run()
    return server.drained
