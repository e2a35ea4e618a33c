"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}`` with the status codes
OpenAI's clients expect, and the exception handlers that produce them."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"


class APIError(Exception):
    """An error to answer with: HTTP ``status`` and the OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    @classmethod
    def bad_request(cls, message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
        return cls(400, message, INVALID_REQUEST, param, code)

    @classmethod
    def unsupported(cls, param: str, what: str) -> APIError:
        return cls(
            400, f"{what} is not supported by this server", INVALID_REQUEST, param, "unsupported_parameter"
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def draining_error() -> APIError:
    return APIError(
        503,
        "the server is shutting down and takes no new requests; retry on another replica",
        UNAVAILABLE,
        code="draining",
    )


def install_handlers(app: FastAPI) -> None:
    """Answer every error (ours, validation, unknown routes, bugs) with an OpenAI error body."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return APIError.bad_request(
                f"the request body is not valid JSON: {first['msg']}", None, "invalid_json"
            ).response()
        param = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
        message = "; ".join(_describe(e) for e in errors[:5])
        return APIError(422, message, INVALID_REQUEST, param, "invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"unknown path {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return JSONResponse(
            error_body(message, INVALID_REQUEST), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request %s %s failed", request.method, request.url.path)
        message = f"internal server error ({type(exc).__name__}); the server log has the details"
        return JSONResponse(error_body(message, SERVER_ERROR), status_code=500)


def _describe(error: dict[str, Any]) -> str:
    where = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
    return f"{where}: {error.get('msg', 'invalid')}" if where else str(error.get("msg", "invalid"))
