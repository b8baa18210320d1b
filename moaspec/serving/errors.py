"""Errors in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause — bad JSON or parameters, a wrong key, an unknown
model or route, an oversized body, a full server — leaves as one of these with a
4xx/503 status and a sentence saying what to change; the server keeps serving.
A message quotes what the client sent only through :func:`shown`, so a 5,000-digit
number or a megabyte of text is not sent back, and a lone surrogate (valid JSON, not
UTF-8) cannot turn the answer into a failure to encode it.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moaspec.errors import MoaspecError, encodable, shown
from moaspec.serving.engine import Overloaded

log = logging.getLogger("moaspec.serve")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
         405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
         499: "invalid_request_error",
         503: "server_overloaded"}


UNION_BRANCHES = frozenset({"str", "int", "float", "bool", "none"})
MESSAGE_CHARS = 1000  # of a whole message


class APIError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        message = encodable(message)
        if len(message) > MESSAGE_CHARS:
            message = message[:MESSAGE_CHARS] + "…"
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type or TYPES.get(status, "server_error")

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    # a union's failed branch is named in the location ('str', 'list[TextPart]', ...): not a parameter name
    loc = [shown(x) for x in e.get("loc", ()) if x != "body" and not (isinstance(x, str) and (x in UNION_BRANCHES or "[" in x))]
    if e.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if e.get("type") == "extra_forbidden":
        return f"unrecognized request argument supplied: {'.'.join(loc)}", ".".join(loc) or None
    if e.get("type") == "missing":
        if not loc:
            return "the request has no body: send a JSON object", None
        return f"missing required parameter: {'.'.join(loc)}", ".".join(loc)
    where = ".".join(loc)
    if not where and e.get("type") in ("model_attributes_type", "dict_type"):  # a JSON array, string or number
        return "the request body must be a JSON object", None
    return (f"invalid value for '{where}': {e.get('msg', 'invalid')}" if where else str(e.get("msg"))), where or None


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = "no such route; see /v1/models, /v1/chat/completions, /v1/completions" if exc.status_code == 404 else str(exc.detail)
        return APIError(exc.status_code, message).response()

    @app.exception_handler(Overloaded)
    async def overloaded(_: Request, exc: Overloaded) -> JSONResponse:
        return APIError(503, str(exc), headers={"Retry-After": "1"}).response()

    @app.exception_handler(MoaspecError)
    async def user_error(_: Request, exc: MoaspecError) -> JSONResponse:
        return APIError(400, str(exc)).response()

    @app.exception_handler(Exception)
    async def bug(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()


def error_body(status: int, message: str, **kw: Any) -> JSONResponse:
    return APIError(status, message, **kw).response()
