"""Errors as OpenAI shapes them: ``{"error": {"message", "type", "param", "code"}}``.

The official client maps the status code to an exception class and reads ``error.message``, so every
failure path here (validation, auth, admission, an unreachable broker or Redis) answers in this form.
"""

from __future__ import annotations

import logging
from typing import Any

from aiokafka.errors import KafkaError
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.store import REDIS_ERRORS

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, code=self.code, param=self.param)


def error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": _text(message),
            "type": _TYPES.get(status, "server_error"),
            "param": None if param is None else _text(param),
            "code": code,
        }
    }


def _text(value: str) -> str:
    # A message may quote the input (a model name, a dict key): one holding a lone surrogate would make
    # the error response itself unencodable. Escape what UTF-8 cannot carry.
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body')}: {e.get('msg')}" for e in errors
        )
        return error_response(
            APIError(422, message or "invalid request", code="invalid_value", param=".".join(loc))
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})))

    @app.exception_handler(KafkaError)
    async def _kafka(_: Request, exc: KafkaError) -> JSONResponse:
        log.warning("broker unavailable: %r", exc)
        return error_response(unavailable("the message broker is unavailable", "broker_unavailable"))

    @app.exception_handler(Exception)
    async def _unhandled(_: Request, exc: Exception) -> JSONResponse:
        # Starlette's last resort answers plain text "Internal Server Error"; clients parse JSON.
        log.error("unhandled error", exc_info=exc)
        return error_response(
            APIError(500, "the server failed to handle this request", code="internal_error")
        )

    for redis_error in REDIS_ERRORS:

        @app.exception_handler(redis_error)
        async def _redis(_: Request, exc: Exception) -> JSONResponse:
            log.warning("Redis unavailable: %r", exc)
            return error_response(
                unavailable("the request store (Redis) is unavailable", "store_unavailable")
            )


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, code=code, headers={"Retry-After": "1"})
