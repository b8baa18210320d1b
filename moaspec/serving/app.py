"""The HTTP server: one FastAPI app for the OpenAI API, the chat page and health.

Cross-cutting rules live here, once: bearer-token authentication (constant-time
comparison), a cap on request bodies (413 before the body is parsed), errors in
OpenAI's format, and the connection timeouts and access log of :func:`server_config`.
The client–server protocol mounts on the same app. FastAPI's generated pages
(``/docs``, ``/openapi.json``) are off: they would answer without the key, and ``/docs``
loads its scripts from a CDN.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from importlib import resources
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from moaspec.clientserver.sessions import SessionStore
from moaspec.errors import MoaspecError
from moaspec.serving.engine import Engine
from moaspec.serving.errors import error_body, install_handlers
from moaspec.serving.openai_api import OpenAIRoutes


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with a 413, declared (Content-Length) or streamed (chunked).

    A streamed body is counted as the app reads it. Past the limit the 413 goes out at
    once, the app is told the client left (so it stops reading), and whatever it answers
    after that is dropped: the 413 is the response, not a body parser's complaint.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._refuse(scope, receive, send)
            return
        seen = 0
        started = refused = False

        async def counted() -> Message:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.limit:
                refused = True
                if not started:  # a streaming response already under way cannot turn into a 413
                    await self._refuse(scope, receive, send)
                return {"type": "http.disconnect"}
            return msg

        async def tracked(msg: Message) -> None:
            nonlocal started
            if refused:
                return
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, counted, tracked)
        except Exception:
            if not refused:  # the app's own failure; only the one this caused is ours to absorb
                raise

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_body(413, f"the request body is over the server's limit of {self.limit} bytes")
        await response(scope, receive, send)


class BearerAuth:
    """Require ``Authorization: Bearer <api_key>`` on every path but the chat page and ``/health``, before
    anything else reads the request, so a client without the key learns nothing, not even whether its
    body parses or a route exists."""

    OPEN = frozenset({"/", "/health"})

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN:
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = header.partition(" ")
            problem = None
            if scheme.lower() != "bearer" or not token.strip():
                problem = "You didn't provide an API key: send 'Authorization: Bearer YOUR_KEY'"
            elif not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
                problem = "Incorrect API key provided"
            if problem:
                await error_body(401, problem, code="invalid_api_key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: Engine, model_name: str, api_key: str | None = None, default_max_tokens: int = 512,
               max_body_bytes: int = 1 << 20, sessions: SessionStore | None = None) -> FastAPI:
    """The whole server for ``engine``; ``model_name`` is the id clients pass as ``model``.

    With ``sessions``, the client–server protocol for remote drafters is served too (``/cs/v1``).
    """
    app = FastAPI(title="moaspec", summary="MoA speculative decoding, OpenAI-compatible", docs_url=None,
                  redoc_url=None, openapi_url=None)
    install_handlers(app)
    app.include_router(OpenAIRoutes(engine, model_name, default_max_tokens).router())
    if sessions is not None:
        from moaspec.clientserver.server import router

        app.include_router(router(sessions, workers=engine.parallel))
    page = resources.files("moaspec.serving").joinpath("static/chat.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def chat_page() -> str:
        return page

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, "method": engine.strategy.describe(), **engine.load}

    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)  # added last, so it runs first
    return app


def listen(host: str, port: int) -> socket.socket:
    """A listening socket, bound here so that a taken port is a clear error, not a uvicorn traceback.

    The protocol is named (IPPROTO_TCP, not 0): asyncio switches Nagle's algorithm off
    only on connections whose socket says TCP, and with Nagle on every response that
    uvicorn writes in two pieces (head, then body) waits for the client's delayed ACK,
    about 40 ms per request on Linux — longer than a verification's target forward.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise MoaspecError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    return sock


HEADER_TIMEOUT_S = 10.0  # from a request's first byte to the end of its headers
IDLE_TIMEOUT_S = 30.0  # a connection with no request under way: just opened, or kept alive after an answer


class _Config(uvicorn.Config):
    """uvicorn's settings, and how long a request's headers may take to arrive."""

    def __init__(self, app: ASGIApp, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.header_timeout = header_timeout


class _TimedH11(H11Protocol):
    """uvicorn's h11 protocol with the two timeouts it lacks.

    uvicorn closes a kept-alive connection that stays idle after an answer, but nothing else: a
    connection that sends nothing, or half a request line and headers, stays open for good, before
    authentication can run (200 such connections stayed open indefinitely). Here a new connection
    is idle like a kept-alive one, and once a request's first byte arrives its headers must be
    complete within ``header_timeout`` however slowly they trickle in (a byte now and then resets
    nothing). The body's size is bounded by :class:`BodyLimit`.
    """

    def __init__(self, config: _Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.header_timeout = config.header_timeout
        self._headers_due: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        if self._headers_due is None and self.conn.their_state is h11.IDLE:
            self._headers_due = self.loop.call_later(self.header_timeout, self._headers_late)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._headers_arrived()

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_arrived()
        super().connection_lost(exc)

    def _headers_arrived(self) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def _headers_late(self) -> None:
        self._headers_due = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers took over %.0f s", self.header_timeout)
            self.transport.close()


class _QueryRedaction(logging.Filter):
    """Keep query strings out of uvicorn's access log: a URL may carry what the client meant to keep to itself
    (an API key, a prompt); the log says only that there was one."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args  # uvicorn's: client address, method, path with query, HTTP version, status
        if isinstance(args, tuple) and len(args) == 5 and isinstance(path := args[2], str):
            record.args = (*args[:2], path.split("?", 1)[0] + ("?…" if "?" in path else ""), *args[3:])
        return True


def server_config(app: FastAPI, log_level: str = "info", header_timeout: float = HEADER_TIMEOUT_S,
                  idle_timeout: float = IDLE_TIMEOUT_S) -> uvicorn.Config:
    """uvicorn's settings for ``app``: h11 (the same protocol, and the same timeouts, whether or not httptools is
    installed), the timeouts of :class:`_TimedH11`, and an access log without query strings."""
    config = _Config(app, header_timeout, http=_TimedH11, log_level=log_level, timeout_graceful_shutdown=5,
                     timeout_keep_alive=idle_timeout)
    access = logging.getLogger("uvicorn.access")  # configured by now: uvicorn.Config sets its loggers up
    if not any(isinstance(f, _QueryRedaction) for f in access.filters):
        access.addFilter(_QueryRedaction())
    return config


def run_server(app: FastAPI, sock: socket.socket, log_level: str = "info") -> None:
    """Serve ``app`` on ``sock`` with uvicorn until interrupted."""
    uvicorn.Server(server_config(app, log_level)).run(sockets=[sock])
