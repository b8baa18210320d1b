"""HTTP routes of the client–server protocol (``/cs/v1``), mounted on the same app as the OpenAI API.

    GET    /cs/v1/info                    what the server holds: state kind and width, limits, target fingerprint
    POST   /cs/v1/sessions                {prompt: [ids], state?, state_format?, max_new_tokens?, target_layers?, drafter?,
                                           sampling?: {temperature, top_k?, top_p?, seed?, presence_penalty?,
                                                       frequency_penalty?, logit_bias?: {"id": bias}},
                                           have_state?, answer_start?, logprobs?: k}
                                          → {session, token, verified, state[, layers][, logprobs]}
    POST   /cs/v1/sessions/{id}/verify    {verified: n, draft: [ids], parents?: [nodes], dists?: [{ids, probs} | null]}
                                          → {accepted, token, verified, state[, layers][, path][, logprobs]}

``logprobs`` in an answer: ``[token, logprob, [[id, logprob], ...]]`` for each newly verified token
(:func:`moaspec.clientserver.codec.encode_logprobs`), the target's own distribution as on one device.
    DELETE /cs/v1/sessions/{id}

Target forwards run on worker threads, at most ``workers`` at once (more would only
share the same cores, and every extra thread grows the allocator's arenas), so a
slow verification never blocks the event loop; requests beyond that wait their turn.
When the store verifies sessions together (its ``batcher``), a verification's thread mostly
waits for the batch, so one session in ``max_sessions`` may verify at once; opens (prefills)
keep to ``workers``.
A client that disconnects while its session's prompt is prefilled stops that prefill
within one chunk (a client whose open timed out would otherwise have the server prefill
its prompt once per retry).
"""

from __future__ import annotations

import threading
from typing import Any, Literal

import anyio
import anyio.to_thread
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt

from moaspec.clientserver.sessions import MAX_SUPPORT, SessionError, SessionStore
from moaspec.decoding.generation import MAX_TOP_LOGPROBS
from moaspec.decoding.sampling import SamplingParams
from moaspec.serving.disconnect import unless_disconnected
from moaspec.serving.errors import APIError
from moaspec.serving.json_limits import BoundedRoute
from moaspec.serving.openai_api import Adjustments


class SamplingRequest(Adjustments):
    """How the session picks the target's tokens; temperature 0 (the default) is greedy."""

    model_config = ConfigDict(extra="forbid")
    temperature: StrictFloat = Field(0.0, ge=0, le=100, allow_inf_nan=False)
    top_k: StrictInt = Field(0, ge=0)
    top_p: StrictFloat = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)

    def params(self, vocab_size: int) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed, self.presence_penalty,
                              self.frequency_penalty, self.bias(vocab_size, "sampling.logit_bias"))


class OpenRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: list[StrictInt]  # strict: JSON's true or 2.0 is not a token id
    state: Literal["moa", "eagle", "none"] = "moa"
    state_format: Literal["fp16", "int8"] = "fp16"
    max_new_tokens: StrictInt | None = Field(None, ge=1)
    target_layers: StrictInt = Field(0, ge=0)  # send the last N layers' K/V too (a client with Target Layer Inference)
    drafter: str | None = Field(None, max_length=64)  # the client's MoA drafter (fingerprint), if the server holds several
    sampling: SamplingRequest = SamplingRequest()
    have_state: StrictInt = Field(0, ge=0)  # the client holds the state of the prompt's first tokens: send the rest
    answer_start: StrictInt | None = Field(None, ge=0)  # the penalised answer began here in the prompt (a reopen)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # each verified token's, with k alternatives


class DraftDist(BaseModel):
    """The distribution one draft was drawn from, over the few tokens it gives probability."""

    model_config = ConfigDict(extra="forbid")
    ids: list[StrictInt] = Field(max_length=MAX_SUPPORT)
    probs: list[StrictFloat] = Field(max_length=MAX_SUPPORT)


class VerifyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    verified: StrictInt = Field(ge=1)
    draft: list[StrictInt]
    parents: list[StrictInt] | None = None  # a draft tree: each node's parent (0: the root, j: draft[j - 1])
    dists: list[DraftDist | None] | None = None  # sampling sessions' chains: what each draft was drawn from

    def draft_dists(self) -> list[tuple[list[int], list[float]] | None] | None:
        return None if self.dists is None else [None if d is None else (d.ids, d.probs) for d in self.dists]


async def _call(limiter: anyio.CapacityLimiter, fn: Any, *args: Any) -> Any:
    try:
        return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)
    except SessionError as exc:
        code = {404: "session_not_found", 409: "session_conflict", 503: "server_overloaded"}.get(exc.status)
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        raise APIError(exc.status, str(exc), code=code, headers=headers) from None


def router(store: SessionStore, workers: int = 2) -> APIRouter:
    r = APIRouter(prefix="/cs/v1", route_class=BoundedRoute)
    limiter = anyio.CapacityLimiter(workers)
    verifying = anyio.CapacityLimiter(store.limits.max_sessions) if store.batcher is not None else limiter

    @r.get("/info")
    async def info() -> dict[str, Any]:
        return store.info()

    @r.post("/sessions")
    async def open_session(req: OpenRequest, request: Request) -> dict[str, Any]:
        gone = threading.Event()

        def check(*_: object) -> None:  # between the prefill's chunks, on the worker thread
            if gone.is_set():
                raise SessionError(499, "the client closed the connection")

        try:
            return await unless_disconnected(
                _call(limiter, store.open, req.prompt, req.state, req.state_format, req.max_new_tokens,
                      req.target_layers, req.drafter, req.sampling.params(store.target.cfg.vocab_size), check,
                      req.have_state, req.answer_start, req.logprobs), request)
        finally:
            gone.set()

    @r.post("/sessions/{sid}/verify")
    async def verify(sid: str, req: VerifyRequest) -> dict[str, Any]:
        return await _call(verifying, store.verify, sid, req.verified, req.draft, req.parents, req.draft_dists())

    @r.delete("/sessions/{sid}", status_code=204)
    async def close(sid: str) -> Response:
        await _call(limiter, store.close, sid)
        return Response(status_code=204)

    return r
