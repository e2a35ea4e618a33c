"""An OpenAI-compatible HTTP server over an ingested corpus (``cacheblend-rag serve``; docs/server.md).

``backend.py`` is the only module that talks to the core; the others speak HTTP and OpenAI.
"""

from .app import ServeState, create_app
from .backend import EngineBackend, RunningRequest
from .process import ServerProcess
from .runner import serve_app

__all__ = ["EngineBackend", "RunningRequest", "ServeState", "ServerProcess", "create_app", "serve_app"]
