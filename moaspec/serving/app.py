"""The HTTP server: one FastAPI app for the OpenAI API, the chat page and health.

Cross-cutting rules live here, once: bearer-token authentication (constant-time
comparison), a cap on request bodies (413 before the body is parsed), and errors in
OpenAI's format. The client–server protocol mounts on the same app.
"""

from __future__ import annotations

import secrets
import socket
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
    """Require ``Authorization: Bearer <api_key>`` on the API's paths (``/v1``, ``/cs/v1``) before anything
    else reads the request, so a client without the key learns nothing, not even whether its body parses.
    The chat page and ``/health`` stay open."""

    PREFIXES = ("/v1/", "/cs/v1/")

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.PREFIXES):
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
    app = FastAPI(title="moaspec", summary="MoA speculative decoding, OpenAI-compatible", docs_url="/docs",
                  redoc_url=None)
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


def run_server(app: FastAPI, sock: socket.socket, log_level: str = "info") -> None:
    """Serve ``app`` on ``sock`` with uvicorn until interrupted."""
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, timeout_keep_alive=30)
    uvicorn.Server(config).run(sockets=[sock])
