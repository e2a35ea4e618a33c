"""The OpenAI-compatible HTTP API over one :class:`~cacheblend_rag.server.backend.EngineBackend`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both streamed as Server-Sent Events with
``"stream": true``), ``GET /v1/models``, ``GET /v1/models/{id}`` and ``GET /health``. Every error is an
OpenAI error body (see ``errors.py``). While the server drains (after SIGTERM, see ``runner.py``) new
requests get a 503 and ``/health`` reports ``draining`` with a 503, so a load balancer stops routing here;
requests already in flight run to the end.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from ..config import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_TOKENS
from .backend import EngineBackend, RunningRequest
from .errors import APIError, draining_error, install_handlers
from .protocol import Answer, ChatCompletionRequest, CompletionRequest, ResponseFrame, model_card
from .relay import ClientGone, collect, relay, sse

log = logging.getLogger(__name__)

# A request that names no max_tokens gets the max_tokens setting (config.DEFAULT_MAX_TOKENS by default),
# not OpenAI's "to the end of the context", which would size every decode row for the whole context and
# leave the batch scheduler room for few requests.


@dataclass
class ServeState:
    """What the drain logic and the routes share. Touched from the event loop's thread only (the signal
    handler runs there too)."""

    draining: bool = False
    in_flight: int = 0


class DrainGate:
    """ASGI middleware: counts the HTTP requests in flight but ``/health`` (a streamed response until its
    last byte) and, while draining, answers new ones with a 503 (``/health`` too: it reports ``draining``)."""

    def __init__(self, app: ASGIApp, state: ServeState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        health = scope["path"] == "/health"
        if self.state.draining:
            body = {"status": "draining"} if health else draining_error().body()
            await JSONResponse(body, status_code=503, headers={"Connection": "close"})(scope, receive, send)
            return
        if health:  # not work to wait for
            await self.app(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


class BodyLimit:
    """ASGI middleware: refuses a request body over ``limit`` bytes with 413 before the app parses any
    of it: at once from its Content-Length, or, for a body sent without one (chunked), as soon as what
    arrived passes the limit (such a body is read here, up to the limit, and handed on)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.limit:
                await self._refuse(scope, receive, send, int(length) if length.isdigit() else None)
                return
            await self.app(scope, receive, send)
            return
        messages: list[dict[str, Any]] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.limit:
                await self._refuse(scope, receive, send, None)
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                break

        async def replay() -> dict[str, Any]:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: int | None) -> None:
        told = f"{size:,}-byte" if size is not None else "larger"
        error = APIError(
            413,
            f"request body too large: a {told} body, the limit is {self.limit:,} bytes "
            "(the max_request_bytes setting, CACHEBLEND_MAX_REQUEST_BYTES)",
            param=None,
            code="request_too_large",
        )
        headers = {"Connection": "close"}  # the rest of the body is not read
        await JSONResponse(error.body(), status_code=413, headers=headers)(scope, receive, send)


def create_app(
    backend: EngineBackend,
    state: ServeState | None = None,
    api_key: str | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The API over ``backend``. ``state``: shared with the runner that drains on SIGTERM. ``api_key``:
    when set, ``/v1`` requests must carry ``Authorization: Bearer <api_key>``. ``max_request_bytes``: a
    larger request body is refused with 413 unread. The backend is closed when the app shuts down."""
    state = state or ServeState()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await run_in_threadpool(backend.close)  # requests already submitted are finished first

    app = FastAPI(title="cacheblend-rag", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    app.add_middleware(DrainGate, state=state)  # added last, so it runs first: a draining server says so
    install_handlers(app)
    authorized = Depends(_authorization(api_key))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        info = await run_in_threadpool(backend.health)
        return {"status": "ok", "in_flight": state.in_flight, **info}

    @app.get("/v1/models", dependencies=[authorized])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(backend.model_id, backend.created, backend.describe())]}

    @app.get("/v1/models/{model_id:path}", dependencies=[authorized])
    async def model(model_id: str) -> dict[str, Any]:
        _check_model(backend, model_id)
        return model_card(backend.model_id, backend.created, backend.describe())

    @app.post("/v1/chat/completions", dependencies=[authorized])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _generate(backend, body, "chat", request, default_max_tokens)

    @app.post("/v1/completions", dependencies=[authorized])
    async def completions(body: CompletionRequest, request: Request):
        return await _generate(backend, body, "text", request, default_max_tokens)

    return app


def _authorization(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "incorrect or missing API key", param=None, code="invalid_api_key")

    return check


def _check_model(backend: EngineBackend, model_id: str) -> None:
    if model_id != backend.model_id:
        raise APIError(
            404,
            f"the model {model_id!r} does not exist; this server serves {backend.model_id!r}",
            param="model",
            code="model_not_found",
        )


async def _generate(
    backend: EngineBackend,
    body: ChatCompletionRequest | CompletionRequest,
    kind: str,
    request: Request,
    default_max_tokens: int,
):
    received = time.perf_counter()
    _check_model(backend, body.model)
    spec = body.to_spec(default_max_tokens)
    running = await run_in_threadpool(backend.start, spec, received)
    frame = ResponseFrame(kind, backend.model_id, backend.fingerprint[:16])
    if body.stream:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        events = _stream(running, frame, body.include_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    try:
        answer = await collect(running, request)
    except ClientGone:
        log.info("client went away before its answer; request cancelled")
        return JSONResponse({}, status_code=499)  # nobody reads it
    return frame.completion(answer)


async def _stream(running: RunningRequest, frame: ResponseFrame, include_usage: bool) -> AsyncIterator[str]:
    """The response's events: text chunks, the closing chunk (finish reason and the ``cacheblend``
    extension), usage if asked for, then ``[DONE]``. A failure after the first byte is sent as an error
    event, as OpenAI does."""
    if frame.kind == "chat":
        yield sse(frame.chunk("", first=True))
    answer: Answer | None = None
    try:
        async for item in relay(running):
            if isinstance(item, Answer):
                answer = item
            elif item:
                yield sse(frame.chunk(item))
    except APIError as exc:
        yield sse(exc.body())
        return
    except Exception as exc:
        log.exception("streamed request failed")
        yield sse(
            {"error": {"message": f"internal server error ({type(exc).__name__})", "type": "server_error"}}
        )
        return
    yield sse(frame.chunk(answer=answer))
    if include_usage:
        yield sse(frame.usage_chunk(answer))
    yield sse("[DONE]")
