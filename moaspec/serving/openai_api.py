"""The OpenAI-compatible API: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

Requests and responses follow OpenAI's shapes, so the official ``openai`` package,
curl scripts and other OpenAI clients work unchanged; streaming uses server-sent
events ending with ``data: [DONE]``. Each response also carries a ``moaspec`` object
(τ, target calls, drafted tokens; per streamed chunk, whether its text came from
accepted drafts) that standard clients ignore. Defaults are OpenAI's: temperature 1,
top_p 1. Log-probabilities (chat: ``logprobs``/``top_logprobs``; completions: ``logprobs``)
are the target's own, before penalties, bias, temperature and top_p, so drafting does
not change them.
``n`` choices (and the completions API's batches of prompts) decode side by side, each
in its own slot; presence and frequency penalties and ``logit_bias`` apply to the
target's verification of every draft; ``echo`` repeats the prompt, with its tokens'
log-probabilities when asked (from the prefill's final states). Parameters moaspec
cannot honour (tools, ``best_of``) are refused with a 400 rather than silently ignored.

A request's prompts are counted against the server's capacity before any of them is read,
and they are tokenised (and chat templates rendered) on a worker thread: a megabyte of
prompts must not hold up the event loop, which answers every other client and ``/health``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import replace
from typing import Annotated, Any, Literal

import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from moaspec.chat import encode_chat, encode_text, outside_vocabulary
from moaspec.decoding.generation import (
    MAX_TOP_LOGPROBS,
    GenerationConfig,
    GenerationResult,
    TokenLogprob,
    length_histogram,
)
from moaspec.decoding.logprobs import LogprobFormat, TokenBytes
from moaspec.decoding.sampling import SamplingParams, logit_bias_pairs
from moaspec.errors import MoaspecError, shown
from moaspec.serving.disconnect import unless_disconnected
from moaspec.serving.engine import Engine, Piece
from moaspec.serving.errors import APIError
from moaspec.serving.json_limits import BoundedRoute

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
# OpenAI takes 4; evaluation harnesses send a task's stop strings and the end-of-text token, often more
MAX_STOPS = 16
MAX_STOP_CHARS = 1000  # each; a task's stop strings are a few words
MAX_TOKEN_ID_DIGITS = 20  # logit_bias keys: a token id is far shorter, and int() refuses strings of over 4,300 digits


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool_call_id, ... carry no text for this model
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class Adjustments(BaseModel):
    """OpenAI's presence and frequency penalties and logit bias, as both endpoints here and the client–server
    protocol's ``sampling`` take them."""

    model_config = ConfigDict(extra="forbid")
    presence_penalty: StrictFloat = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: StrictFloat = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: dict[Annotated[str, Field(max_length=MAX_TOKEN_ID_DIGITS)],
                     Annotated[StrictFloat, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None

    def bias(self, vocab_size: int, param: str = "logit_bias") -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs; its keys are token ids written as strings (``param``: the
        field's name in an error)."""
        try:
            return logit_bias_pairs(self.logit_bias, vocab_size)
        except MoaspecError as exc:
            raise APIError(400, str(exc), param=param) from None


class _Common(Adjustments):
    """Parameters shared by both endpoints; unknown ones are refused (a typo should not pass silently)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    # strict numbers and booleans: JSON's true is not a token count, nor "yes" a boolean, nor NaN a temperature
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: StrictFloat = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    n: StrictInt = Field(1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise APIError(400, "a stop string must not be empty", param="stop")
        if len(stops) > MAX_STOPS:
            raise APIError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise APIError(400, f"a stop string may have at most {MAX_STOP_CHARS} characters", param="stop")
        return tuple(stops)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def alternatives(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    max_tokens: StrictInt | None = Field(None, ge=0)  # 0 with echo: score the prompt, write nothing
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the completions API's is a count

    def alternatives(self) -> int | None:
        return self.logprobs

    def items(self) -> list[str | list[int]]:
        """The prompts: one (a string, or a list of token ids), or each of a batch."""
        raw = self.prompt
        return [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else raw  # type: ignore[return-value]


def _usage(results: Sequence[GenerationResult], n: int) -> dict[str, Any]:
    """Token counts of a response: each prompt once, every choice's completion (``results`` in index order, each
    prompt's ``n`` choices together)."""
    per_prompt = [results[p : p + n] for p in range(0, len(results), n)]
    prompt, completion = sum(c[0].prompt_tokens for c in per_prompt), sum(r.new_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            # OpenAI's name for the prompt tokens a cache supplied: per prompt, its first choice's (the others
            # copy what that one read, or what it found cached)
            "prompt_tokens_details": {"cached_tokens": sum(min(r.reused_prompt_tokens for r in c) for c in per_prompt)}}


def _stats(results: Sequence[GenerationResult], pieces: Sequence[Piece], method: str) -> dict[str, Any]:
    """How the choices were decoded, together (τ over every target call of every choice)."""
    accepted = [n for r in results for n in r.accepted_lengths]
    total_s = max(r.total_s for r in results)
    return {
        "method": method, "tau": round(sum(accepted) / len(accepted) if accepted else 0.0, 4),
        "target_calls": sum(r.target_calls + 1 for r in results),  # + each choice's prefill
        "accepted_histogram": length_histogram(accepted),
        "drafted_chars": sum(len(p.text) for p in pieces if p.drafted),
        "tokens_per_s": round(sum(r.new_tokens for r in results) / total_s if total_s > 0 else 0.0, 2),
        "prefill_s": round(max(r.prefill_s for r in results), 4), "total_s": round(total_s, 4),
    }


def _sse(obj: dict[str, Any] | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()


class OpenAIRoutes:
    """Binds the routes to an engine and the name the model is served under."""

    def __init__(self, engine: Engine, model_name: str, default_max_tokens: int) -> None:
        self.engine = engine
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())
        self.token_bytes = TokenBytes(engine.target.tokenizer)

    def router(self) -> APIRouter:
        r = APIRouter(prefix="/v1", route_class=BoundedRoute)
        r.add_api_route("/models", self.models, methods=["GET"])
        r.add_api_route("/models/{model_id:path}", self.model, methods=["GET"])
        r.add_api_route("/chat/completions", self.chat, methods=["POST"])
        r.add_api_route("/completions", self.completions, methods=["POST"])
        return r

    # --- model list -----------------------------------------------------------------------

    def _card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "moaspec",
                "moaspec": {"method": self.engine.strategy.describe(), "context_window": self.engine.context}}

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._card()]}

    async def model(self, model_id: str) -> dict[str, Any]:
        self._check_model(model_id)
        return self._card()

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model '{shown(name)}' does not exist; this server serves '{self.model_name}'",
                           type="invalid_request_error", param="model", code="model_not_found")

    # --- generation ---------------------------------------------------------------------

    def _config(self, req: ChatRequest | CompletionRequest, prompt_len: int, max_tokens: int | None,
                echo: bool = False) -> GenerationConfig:
        context = self.engine.context
        if prompt_len >= context:
            raise APIError(400, f"This model's maximum context length is {context} tokens, but the prompt has "
                                f"{prompt_len} tokens. Please shorten it.",
                           param="messages" if isinstance(req, ChatRequest) else "prompt", code="context_length_exceeded")
        room = context - prompt_len
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the "
                                "completion). Please reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                  presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                  logit_bias=req.bias(self.engine.target.cfg.vocab_size))
        logprobs = req.alternatives()
        return GenerationConfig(max_new_tokens=max_tokens or min(self.default_max_tokens, room), sampling=sampling,
                                stop=req.stops(), logprobs=logprobs, prompt_logprobs=logprobs if echo else None)

    def _encode(self, fn: Callable[[], list[int]], param: str) -> list[int]:
        try:
            return fn()
        except MoaspecError as exc:
            raise APIError(400, str(exc), param=param) from None

    def _check_capacity(self, req: _Common, prompts: int) -> None:
        """Refuse more choices than the server holds at once, before any prompt is read."""
        total = req.n * prompts
        if total > self.engine.capacity:
            raise APIError(400, f"{total} choices ({prompts} prompts × n = {req.n}) are more than this server "
                                f"decodes and queues at once ({self.engine.capacity})", param="n")

    async def chat(self, req: ChatRequest, request: Request) -> Any:
        self._check_model(req.model)
        self._check_capacity(req, 1)

        def prepare() -> tuple[list[int], GenerationConfig]:
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        for m in req.messages]
            ids = self._encode(lambda: encode_chat(self.engine.target.tokenizer, messages), "messages")
            return ids, self._config(req, len(ids), req.max_completion_tokens or req.max_tokens)

        ids, config = await anyio.to_thread.run_sync(prepare)
        return await self._respond(req, request, [ids], [config], chat=True)

    def _prompts(self, req: CompletionRequest) -> list[tuple[list[int], str]]:
        """The request's prompts (one, or a batch) as token ids, each with its text (what ``echo`` repeats)."""
        vocab, tokenizer = self.engine.target.cfg.vocab_size, self.engine.target.tokenizer
        items = req.items()
        if not items:
            raise APIError(400, "the prompt is empty", param="prompt")
        prompts = []
        for item in items:
            if isinstance(item, str):
                ids = self._encode(lambda text=item: encode_text(tokenizer, text), "prompt")  # type: ignore[misc]
                text = item
            else:
                ids = list(item)
                bad = outside_vocabulary(ids, vocab)
                if bad is not None:
                    raise APIError(400, f"prompt token id {shown(bad)} is outside the vocabulary [0, {vocab})",
                                   param="prompt")
                text = str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))
            if not ids:
                raise APIError(400, "the prompt is empty", param="prompt")
            prompts.append((ids, text))
        return prompts

    async def completions(self, req: CompletionRequest, request: Request) -> Any:
        self._check_model(req.model)
        if req.echo and req.stream and req.logprobs is not None:
            raise APIError(400, "echo with logprobs is answered whole: ask for it without stream", param="echo")
        scoring = req.max_tokens == 0  # the prompt's log-probabilities alone (one token is decoded, then dropped)
        if scoring and (not req.echo or req.stream):
            raise APIError(400, "max_tokens 0 scores the prompt: it needs echo, and is answered whole (no stream)",
                           param="max_tokens")
        self._check_capacity(req, len(req.items()))

        def prepare() -> tuple[list[tuple[list[int], str]], list[GenerationConfig]]:
            prompts = self._prompts(req)
            return prompts, [self._config(req, len(ids), 1 if scoring else req.max_tokens, echo=req.echo)
                             for ids, _ in prompts]

        prompts, configs = await anyio.to_thread.run_sync(prepare)
        return await self._respond(req, request, [ids for ids, _ in prompts], configs, chat=False,
                                   echoes=[text for _, text in prompts] if req.echo else None, scoring=scoring)

    def _choices(self, req: _Common, prompts: list[list[int]], configs: list[GenerationConfig]
                 ) -> tuple[list[list[int]], list[GenerationConfig]]:
        """Each prompt's ``n`` choices, choice ``j`` of prompt ``p`` at index ``p·n + j`` (OpenAI's order): their
        prompts and configs. With a ``seed``, choice ``j`` samples with ``seed + j`` (choice 0 as when n = 1)."""
        choices: list[GenerationConfig] = []
        for config in configs:
            seed = config.sampling.seed
            choices += [config if seed is None or j == 0 else
                        replace(config, sampling=replace(config.sampling, seed=(seed + j) % 2**63)) for j in range(req.n)]
        return [ids for ids in prompts for _ in range(req.n)], choices

    async def _respond(self, req: _Common, request: Request, prompts: list[list[int]], configs: list[GenerationConfig],
                       chat: bool, echoes: list[str] | None = None, scoring: bool = False) -> Any:
        """Answer every prompt's choices; ``echoes``: each prompt's text, to put before its choices' text;
        ``scoring``: keep none of the answers (max_tokens 0: the echoed prompt alone)."""
        prompts, configs = self._choices(req, prompts, configs)
        echo = [echoes[i // req.n] for i in range(len(configs))] if echoes is not None else None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name}
        stream = self.engine.streams(prompts, configs)
        formats = [LogprobFormat(self.token_bytes, chat) if config.logprobs is not None else None for config in configs]
        if req.stream:
            # admission errors (503) still become a proper response; a client that leaves during a long
            # prefill, before the response has begun, is noticed here (later, by the streaming response)
            first = await unless_disconnected(anext(stream), request)
            return StreamingResponse(self._events(head, first, stream, chat, req, formats, echo),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        results, pieces = await unless_disconnected(self._collect(stream, len(configs)), request)
        if scoring:
            results = [replace(r, token_ids=[], text="", finish_reason="length", logprobs=[]) for r in results]
        choices = []
        for i, (result, lp, ids) in enumerate(zip(results, formats, prompts)):
            logprobs = None
            if lp is not None:  # with echo, the prompt's entries first (its first token has none), then the answer's
                prompt_part = lp.prompt(ids, result.prompt_logprobs or []) if echo is not None else None
                logprobs = lp.joined(prompt_part, lp(result.logprobs or []))
            choice: dict[str, Any] = {"index": i, "logprobs": logprobs, "finish_reason": FINISH[result.finish_reason]}
            if chat:
                choice["message"] = {"role": "assistant", "content": result.text}
            else:
                choice["text"] = (echo[i] if echo is not None else "") + result.text
            choices.append(choice)
        return JSONResponse({**head, "choices": choices, "usage": _usage(results, req.n),
                             "moaspec": _stats(results, pieces, self.engine.strategy.describe())})

    @staticmethod
    async def _collect(stream: AsyncGenerator[tuple[int, Piece | GenerationResult], None], n: int
                       ) -> tuple[list[GenerationResult], list[Piece]]:
        """Run to the end: each choice's result, and the pieces of text on the way."""
        results: dict[int, GenerationResult] = {}
        pieces: list[Piece] = []
        async with aclosing(stream):
            async for i, item in stream:
                if isinstance(item, GenerationResult):
                    results[i] = item
                else:
                    pieces.append(item)
        if len(results) != n:
            raise RuntimeError("generation ended without a result")
        return [results[i] for i in range(n)], pieces

    async def _events(self, head: dict[str, Any], first: tuple[int, Piece | GenerationResult],
                      stream: AsyncGenerator[tuple[int, Piece | GenerationResult], None], chat: bool, req: _Common,
                      formats: list[LogprobFormat | None], echo: list[str] | None) -> AsyncIterator[bytes]:
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        told = [0] * len(formats)  # log-probability entries sent so far, per choice

        def chunk(i: int, text: str | None, finish: str | None, entries: Sequence[TokenLogprob],
                  **extra: Any) -> dict[str, Any]:
            told[i] += len(entries)
            lp = formats[i](entries) if formats[i] else None  # type: ignore[misc]
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish}
            return {**head, "choices": [choice], **extra}

        if chat:
            for i in range(len(formats)):
                yield _sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
        for i, text in enumerate(echo or []):  # (never with log-probabilities: those are answered whole)
            yield _sse(chunk(i, text, None, ()))
        pieces: list[list[Piece]] = [[] for _ in formats]
        results: dict[int, GenerationResult] = {}
        method = self.engine.strategy.describe()
        async with aclosing(stream):
            i, item = first
            while True:
                if isinstance(item, GenerationResult):
                    # the entries of tokens whose text never came out (held back as a possible stop string) end it
                    results[i] = item
                    yield _sse(chunk(i, None, FINISH[item.finish_reason], (item.logprobs or [])[told[i]:],
                                     moaspec=_stats([item], pieces[i], method)))
                    if len(results) == len(formats):
                        break
                else:
                    pieces[i].append(item)
                    yield _sse(chunk(i, item.text, None, item.logprobs, moaspec={"drafted": item.drafted}))
                i, item = await anext(stream)
        if req.stream_options and req.stream_options.include_usage:
            yield _sse({**head, "choices": [], "usage": _usage([results[i] for i in range(len(results))], req.n)})
        yield _sse("[DONE]")
