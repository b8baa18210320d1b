"""HTTP routes of the client–server protocol (``/cs/v1``), mounted on the same app as the OpenAI API.

    GET    /cs/v1/info                    what the server holds: state kind and width, limits, target fingerprint
    POST   /cs/v1/sessions                {prompt: [ids], state?, state_format?, max_new_tokens?} → {session, token, verified, state}
    POST   /cs/v1/sessions/{id}/verify    {verified: n, draft: [ids]} → {accepted, token, verified, state}
    DELETE /cs/v1/sessions/{id}

Target forwards run on FastAPI's worker threads (the handlers are plain functions),
so one slow verification never blocks the event loop or other sessions.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel, ConfigDict, Field

from moaspec.clientserver.sessions import SessionError, SessionStore
from moaspec.serving.errors import APIError


class OpenRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: list[int]
    state: Literal["moa", "eagle", "none"] = "moa"
    state_format: Literal["fp16", "int8"] = "fp16"
    max_new_tokens: int | None = Field(None, ge=1)


class VerifyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    verified: int = Field(ge=1)
    draft: list[int]


def _call(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except SessionError as exc:
        code = {404: "session_not_found", 409: "session_conflict", 503: "server_overloaded"}.get(exc.status)
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        raise APIError(exc.status, str(exc), code=code, headers=headers) from None


def router(store: SessionStore, auth: Any) -> APIRouter:
    r = APIRouter(prefix="/cs/v1", dependencies=[Depends(auth)])

    @r.get("/info")
    def info() -> dict[str, Any]:
        return store.info()

    @r.post("/sessions")
    def open_session(req: OpenRequest) -> dict[str, Any]:
        return _call(store.open, req.prompt, req.state, req.state_format, req.max_new_tokens)

    @r.post("/sessions/{sid}/verify")
    def verify(sid: str, req: VerifyRequest) -> dict[str, Any]:
        return _call(store.verify, sid, req.verified, req.draft)

    @r.delete("/sessions/{sid}", status_code=204)
    def close(sid: str) -> Response:
        _call(store.close, sid)
        return Response(status_code=204)

    return r
