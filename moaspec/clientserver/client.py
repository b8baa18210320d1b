"""The client's half: a drafter (MoA, or EAGLE) that drafts locally and asks a remote target to verify.

    open a session (the server prefills the prompt) → the target's first token and the
    prompt's memory entries
    repeat: draft a chain (or an EAGLE-2 dynamic tree) locally → the server verifies it in
            one target forward → keep the accepted drafts and the target's token, add the
            new memory entries

With ``lookup`` on, a chain copied by prompt lookup (:mod:`moaspec.decoding.lookup`)
goes out instead of the drafter's wherever the newest tokens occurred before: it costs
the client nothing and is often longer than the drafter's chain would be accepted.

When the server cannot be reached the client keeps generating alone: its drafts are
kept as *unverified* tokens (shown apart), the memory stops growing, and drafting goes
on T steps past the last verified state. Once the server answers again, the
unverified tail is sent for verification in pieces; generation continues from the
first disagreement, so the final text is again exactly the target's greedy output.
Offline, only the drafter writes: a lookup copy is a guess that needs verifying, and
copying loops is what an unverified text must not do.

Sampling (a temperature above 0): the session samples the target's tokens, and the
client samples its drafts from its drafter with the same settings, restricted to the
drafter's ``DRAFT_SUPPORT`` likeliest tokens, so that each draft's whole distribution
travels with it in a few hundred bytes and the server verifies it by speculative
sampling (:mod:`moaspec.clientserver.sessions`). Prompt-lookup copies and tree nodes
travel without one and are verified as point masses. Offline the drafter writes the
same way, and the server verifies that tail, distributions included, when it is back.

Presence and frequency penalties and a logit bias (``GenerationConfig.sampling``) are the
server's to apply, as it verifies; the drafter drafts without them, as on one device, so
text written alone while the server is away follows neither until it is verified. With
``GenerationConfig.logprobs`` the server sends each verified token's log-probabilities.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import httpx
import torch

from moaspec.chat import check_fits
from moaspec.clientserver import codec
from moaspec.clientserver.sessions import MAX_SUPPORT
from moaspec.decoding.detokenize import Detokenizer
from moaspec.decoding.generation import GenerationConfig, TokenLogprob, TokenSink
from moaspec.decoding.lookup import MIN_NGRAM_BEFORE_DRAFTER, NgramIndex
from moaspec.decoding.prefill import common_prefix
from moaspec.decoding.proposer import check_confidence
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.speculative import DEFAULT_CHAIN
from moaspec.decoding.tree import TreeShape
from moaspec.drafters.base import Drafter
from moaspec.drafters.eagle import EagleDrafter
from moaspec.drafters.independent import IndependentDrafter
from moaspec.drafters.moa import MoADrafter
from moaspec.drafters.proposers import EagleProposer, IndependentProposer, MoAProposer, proposer_for
from moaspec.errors import MoaspecError
from moaspec.models.kv_cache import KVCache

GREEDY = SamplingParams()
DRAFT_SUPPORT = 32  # a sampled draft is drawn from the drafter's likeliest tokens, at most this many
# After a disconnection the text written alone is verified in pieces of 8 tokens first, each piece kept whole
# doubling the next (up to max_draft): the target keeps a token or two of it on the median prompt, and on a CPU a
# verification of 8 costs about what one of 1 does, while one of 64 costs several (BENCHMARKS.md, Client–server).
RESYNC_FIRST_PIECE = 8
Dist = tuple[list[int], list[float]] | None  # what a draft was drawn from (token ids, probabilities); None: a point mass
PieceKind = str  # "target" (the target's own token), "draft" (an accepted draft), "unverified"


class ServerUnreachable(Exception):
    """No answer from the server (connection refused or lost, timeout, 5xx) after the retries."""


class ServerRefused(MoaspecError):
    """The server answered with a 4xx: the request itself is wrong."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"server refused the request ({status}): {message}")
        self.status = status


class NotAMoaspecServer(MoaspecError):
    """Something answered, but not in moaspec's protocol (a web page, another service).

    Its body (often a whole HTML page) would only bury the point, so it is left out.
    """

    def __init__(self, url: str, request: str, answer: str) -> None:
        super().__init__(f"{url}: not a moaspec server ({request} answered {answer})")


DEFAULT_PORTS = {"http": 80, "https": 443}


def parse_server_url(url: str) -> tuple[str, int]:
    """``(host, port)`` of a server URL, or a MoaspecError saying why it is not one.

    Checked once, up front, so that a mistyped ``--server`` is one clear sentence instead
    of a traceback from httpx or urllib, or a misleading "connection refused" (port 99999).
    """
    try:
        parts = urlsplit(url)
        port = parts.port  # parsed lazily: raises here for a port that is not a number in 0..65535
        httpx.URL(url)  # and what httpx refuses beyond that
    except (ValueError, httpx.InvalidURL) as exc:
        why = str(exc)
    else:
        if parts.scheme not in DEFAULT_PORTS:
            why = "the scheme must be http or https"
        elif not parts.hostname:
            why = "it names no host"
        elif port == 0:
            why = "the port must be in 1..65535"
        elif (path := parts.path.rstrip("/")).endswith("/v1"):  # the OpenAI API's base URL, copied
            suffix = "/cs/v1" if path.endswith("/cs/v1") else "/v1"
            why = f"give the server's own address, without {suffix}: {parts.scheme}://{parts.netloc}{path.removesuffix(suffix)}"
        else:
            return parts.hostname, port or DEFAULT_PORTS[parts.scheme]
    raise MoaspecError(f"--server URL is not a valid http(s) URL: {url!r} ({why})")


def _error_message(resp: httpx.Response) -> str | None:
    """The message of a moaspec (OpenAI-style) error body; None when the body is not one."""
    try:
        message = resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return None
    return message if isinstance(message, str) else None


# Opening a session waits for the server to read the prompt, which takes time in proportion to its length
# (4,100 tokens: ~9 s on a 2-core CPU), so an open may take this much longer per prompt token than
# another request; with the plain timeout, prompts the server accepts timed out there on every retry.
OPEN_S_PER_PROMPT_TOKEN = 0.01


class RemoteTarget:
    """The server's ``/cs/v1`` protocol over HTTP, with timeouts, retries and byte counts."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 10.0, retries: int = 2,
                 backoff: float = 0.2) -> None:
        parse_server_url(url)
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # TCP_NODELAY: small latency-bound requests must never wait on Nagle's algorithm for an ACK
        transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        self.http = httpx.Client(base_url=self.url + "/cs/v1", headers=headers, timeout=timeout,
                                 transport=transport)
        self.timeout = timeout
        self.retries, self.backoff = retries, backoff
        self.calls = 0
        self.bytes_sent = 0
        self.bytes_received = 0

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None, retries: int | None = None,
                 timeout: float | None = None) -> Any:
        attempts = 1 + (self.retries if retries is None else retries)
        for attempt in range(attempts):
            try:
                resp = self.http.request(method, path, json=body, timeout=timeout or self.timeout)
            except httpx.TransportError as exc:
                error: str = f"{type(exc).__name__}: {exc}"
            else:
                self.calls += 1
                self.bytes_sent += len(resp.request.content)
                self.bytes_received += len(resp.content)
                status, request = resp.status_code, f"{method} {resp.request.url.path}"
                if status < 400:
                    try:
                        return resp.json() if resp.content else None
                    except ValueError:
                        raise NotAMoaspecServer(self.url, request, f"{status} without JSON") from None
                message = _error_message(resp)
                if status < 500 and status != 429:
                    if message is None:
                        raise NotAMoaspecServer(self.url, request, str(status))
                    raise ServerRefused(status, message)
                error = f"{status}: {message}" if message is not None else f"{request} answered {status}"
            if attempt + 1 < attempts:
                time.sleep(self.backoff * 2**attempt)
        raise ServerUnreachable(error)

    def info(self) -> dict[str, Any]:
        """What the server holds; JSON without the keys the client relies on is some other service's."""
        answer = self._request("GET", "/info")
        if not isinstance(answer, dict) or not {"fingerprint", "max_draft"} <= answer.keys():
            raise NotAMoaspecServer(self.url, "GET /cs/v1/info", "JSON without a fingerprint and max_draft")
        return answer

    def open(self, prompt: Sequence[int], kind: str, fmt: str, max_new_tokens: int, layers: int = 0,
             drafter: str | None = None, sampling: SamplingParams = GREEDY, have_state: int = 0,
             answer_start: int | None = None, logprobs: int | None = None) -> dict[str, Any]:
        """Open a session; ``have_state``: the client holds the state of the prompt's first tokens (only servers
        whose info says ``have_state`` take it); ``answer_start``: where the answer the penalties count began
        in ``prompt``, when not after it; ``logprobs``: have each verified token's log-probabilities sent, with
        this many alternatives. Only what is asked for is sent, so servers that predate an option still serve
        the clients that leave it out."""
        body: dict[str, Any] = {"prompt": list(prompt), "state": kind, "state_format": fmt,
                                "max_new_tokens": max_new_tokens}
        if have_state:
            body["have_state"] = have_state
        if layers:
            body["target_layers"] = layers
        if drafter:
            body["drafter"] = drafter
        if answer_start is not None:
            body["answer_start"] = answer_start
        if logprobs is not None:
            body["logprobs"] = logprobs
        if not sampling.greedy or sampling.adjusted:
            body["sampling"] = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                                "seed": sampling.seed}
            if sampling.penalized:
                body["sampling"] |= {"presence_penalty": sampling.presence_penalty,
                                     "frequency_penalty": sampling.frequency_penalty}
            if sampling.logit_bias:
                body["sampling"]["logit_bias"] = {str(t): b for t, b in sampling.logit_bias}
        return self._request("POST", "/sessions", body, timeout=self.timeout + OPEN_S_PER_PROMPT_TOKEN * len(prompt))

    def verify(self, session: str, verified: int, draft: Sequence[int], retries: int | None = None,
               parents: Sequence[int] | None = None, dists: Sequence[Dist] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"verified": verified, "draft": list(draft)}
        if parents is not None:
            body["parents"] = list(parents)
        if dists is not None and any(d is not None for d in dists):
            body["dists"] = [None if d is None else {"ids": d[0], "probs": d[1]} for d in dists]
        return self._request("POST", f"/sessions/{session}/verify", body, retries)

    def close(self, session: str) -> None:
        try:
            self._request("DELETE", f"/sessions/{session}", retries=0)
        except (ServerUnreachable, MoaspecError):  # unreachable, refused, or not answering as moaspec does
            pass  # it expires on its own

    def shutdown(self) -> None:
        self.http.close()


@dataclass
class _View:
    """Stands in for the target's cache on the client: how many tokens are settled, and the room."""

    length: int
    capacity: int


class SplitMoAProposer(MoAProposer):
    """A MoA proposer whose memory entries arrive from the server instead of being computed here.

    With Target Layer Inference (N > 0) the client runs its copy of the target's last N
    layers: their K/V for verified tokens arrive with the memory entries and fill a
    cache of N layers, which drafted tokens extend as they would the target's.
    """

    state_kind = "moa"
    tli: KVCache | None = None

    @property
    def layers(self) -> int:
        """How many of the target's last layers' K/V this client needs from the server."""
        return self.drafter.cfg.tli_layers

    def _begin(self, hidden: torch.Tensor | None) -> None:
        assert self.cache is not None
        self.state = self.drafter.new_state(self.cache.capacity)
        if self.layers:
            cfg, target = self.drafter.target.cfg, self.drafter.target
            self.tli = KVCache(self.layers, cfg.num_kv_heads, cfg.head_dim, self.cache.capacity, 1, target.dtype,
                               target.device)

    def _tli_cache(self) -> Any:
        return self.tli if self.tli is not None else self.cache

    def _rollback(self, verified: int, keep_slots: list[int] | None, hidden: torch.Tensor | None) -> None:
        assert self.state is not None
        self._keep_accepted(self.state.sa, verified, keep_slots)

    def held(self) -> int:
        """Leading positions whose state here all came from verified tokens: SA's entries, the memory (and the
        target layers' K/V). A verification's newest token, and an unverified tail, are past them."""
        assert self.state is not None
        n = min(self.state.sa.length, self.state.memory.length)
        return n if self.tli is None else min(n, self.tli.length)

    def carry(self, old: SplitMoAProposer, n: int) -> None:
        """Begin with ``old``'s state of the first ``n`` positions (at most its :meth:`held`; the same tokens)."""
        assert self.state is not None and old.state is not None
        pairs = [(self.state.sa, old.state.sa), (self.state.memory, old.state.memory)]
        if self.tli is not None and old.tli is not None:
            pairs.append((self.tli, old.tli))
        for new, prev in pairs:
            new.load_prefix(prev.keys, prev.values, n)

    def receive(self, start: int, entries: torch.Tensor) -> None:
        """Add memory entries for positions ``start..``; those already held are skipped."""
        assert self.state is not None
        have = self.state.memory.length
        if start > have:
            raise MoaspecError(f"memory entries from position {start} leave a gap after {have}")
        if start + entries.shape[0] > have:
            self.drafter.remember(self.state, have, entries[have - start:])

    def receive_layers(self, start: int, kv: torch.Tensor) -> None:
        """The last N layers' K/V for positions ``start..``: ``[T * N, 2 * kv_dim]`` rows, token-major."""
        assert self.tli is not None
        cfg, n = self.drafter.target.cfg, self.layers
        if kv.shape[1] != 2 * cfg.kv_dim or kv.shape[0] % n:
            raise MoaspecError(f"the server sent target-layer K/V of shape {list(kv.shape)}; this client runs the "
                               f"last {n} layers and needs rows of {2 * cfg.kv_dim}, {n} per token")
        have, T = self.tli.length, kv.shape[0] // n
        if start > have:
            raise MoaspecError(f"target-layer K/V from position {start} leave a gap after {have}")
        if start + T > have:
            self.tli.put_token_kv(have, kv.view(1, T, n, -1)[:, have - start :])


class SplitEagleProposer(EagleProposer):
    """An EAGLE proposer fed the target's hidden states by the server.

    EAGLE needs a feature for every token it reads. For tokens the server has not
    verified (drafts, or everything generated while it is unreachable) it uses the
    features it predicted itself, which is all an EAGLE drafter can do alone.
    """

    state_kind = "eagle"
    true = 0  # leading positions whose features came from the server

    def _begin(self, hidden: torch.Tensor | None) -> None:
        assert self.cache is not None
        self.own = self.drafter.new_cache(self.cache.capacity)
        self.features = torch.zeros(self.cache.capacity, self.drafter.cfg.hidden_size, device=self.device,
                                    dtype=self.drafter.weight_dtype)
        self.true = 0

    def held(self) -> int:
        """Leading positions whose feature and drafter entry here both came from the target's features."""
        assert self.own is not None
        return min(self.own.length, self.true)

    def carry(self, old: SplitEagleProposer, n: int) -> None:
        """Begin with ``old``'s features and entries of the first ``n`` positions (at most its :meth:`held`)."""
        assert self.own is not None and self.features is not None and old.own is not None and old.features is not None
        self.own.load_prefix(old.own.keys, old.own.values, n)
        self.features[:n] = old.features[:n]
        self.true = n

    def _feed(self, tokens, positions, mask, parent_features, outputs):  # type: ignore[no-untyped-def]
        logits, feats = super()._feed(tokens, positions, mask, parent_features, outputs)
        assert self.features is not None
        self.features[positions[-outputs:]] = feats.to(self.features.dtype)  # predicted until the server's arrive
        return logits, feats

    def _rollback(self, verified: int, keep_slots: list[int] | None, hidden: torch.Tensor | None) -> None:
        assert self.own is not None
        self.own.truncate(min(self.own.length, verified))

    def receive(self, start: int, entries: torch.Tensor) -> None:
        """True features for positions ``start..``: entries made from predicted ones after ``start`` are redone."""
        assert self.own is not None and self.features is not None
        self.features[start : start + entries.shape[0]] = entries.to(self.features.dtype)
        self.own.truncate(min(self.own.length, start + 1))
        if start <= self.true:
            self.true = max(self.true, start + entries.shape[0])


class SplitIndependentProposer(IndependentProposer):
    """Classic speculative decoding across the network: the drafter needs nothing from the server but its verdicts."""

    state_kind = "none"  # SplitGeneration asks for no state and has nothing to hand it

    def held(self) -> int:
        """Leading positions with an entry in the drafter's cache (the generation carries only verified ones)."""
        assert self.own is not None
        return self.own.length

    def carry(self, old: SplitIndependentProposer, n: int) -> None:
        """Begin with ``old``'s cache of the first ``n`` positions: a next turn reads only its new tokens."""
        assert self.own is not None and old.own is not None
        self.own.load_prefix(old.own.keys, old.own.values, n)


SplitProposer = SplitMoAProposer | SplitEagleProposer | SplitIndependentProposer


SPLIT_PROPOSERS: dict[type[Drafter], Callable[[Any], SplitProposer]] = {
    MoADrafter: SplitMoAProposer, EagleDrafter: SplitEagleProposer, IndependentDrafter: SplitIndependentProposer}


def split_proposer(drafter: Drafter, confidence: float = 0.0) -> SplitProposer:
    """A fresh client-side proposer for ``drafter`` (one per generation); ``confidence`` as for one device."""
    return proposer_for(drafter, confidence, SPLIT_PROPOSERS, "client–server ")


@dataclass
class SplitResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    total_s: float
    ttft_s: float
    server_calls: int
    bytes_sent: int
    bytes_received: int
    state_bytes: int
    accepted_lengths: list[int] = field(default_factory=list)  # tokens verified per verification
    unverified: int = 0  # trailing tokens the server never verified (it was unreachable to the end)
    offline_tokens: int = 0  # tokens generated while the server was unreachable
    resyncs: int = 0
    pipeline_hits: int = 0
    cached_tokens: int = 0  # prompt tokens the server did not read again (its prompt cache held them), over every open
    carried_tokens: int = 0  # prompt tokens whose state the client held from its last turn (not sent again), ditto
    logprobs: list[TokenLogprob] | None = None  # one per verified token of token_ids, when the config asked for them

    @property
    def tau(self) -> float:
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 0.0

    def to_dict(self) -> dict[str, Any]:
        n = max(1, len(self.token_ids))
        return {"text": self.text, "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
                "new_tokens": len(self.token_ids), "tau": round(self.tau, 4), "server_calls": self.server_calls,
                "total_s": round(self.total_s, 4), "ttft_s": round(self.ttft_s, 4),
                "tokens_per_s": round(len(self.token_ids) / self.total_s, 3) if self.total_s else 0.0,
                "bytes_per_token": round((self.bytes_sent + self.bytes_received) / n, 1),
                "state_bytes_per_token": round(self.state_bytes / n, 1), "unverified": self.unverified,
                "offline_tokens": self.offline_tokens, "resyncs": self.resyncs,
                "pipeline_hits": self.pipeline_hits, "cached_tokens": self.cached_tokens,
                "carried_tokens": self.carried_tokens}


def _sparse(probs: torch.Tensor) -> Dist:
    """A draft's distribution ``[V]`` as (token ids, probabilities) of the tokens it gives any probability;
    None (verified as a point mass, still lossless) in the rare case of more than the server takes."""
    ids = probs.nonzero().squeeze(-1)
    if len(ids) > MAX_SUPPORT:
        return None
    return ids.tolist(), probs[ids].tolist()


class SplitGeneration:
    """One generation with a local drafter and a remote target, greedy or sampled (``GenerationConfig.sampling``)."""

    def __init__(self, drafter: Drafter, tokenizer: Any, remote: RemoteTarget, eos: set[int], draft_len: int = DEFAULT_CHAIN,
                 fmt: str = "fp16", max_draft: int = 64, retry_every: int = 8, pipeline: bool = True, lookup: int = 0,
                 tree: TreeShape | None = None, on_piece: Callable[[str, PieceKind], None] | None = None,
                 on_event: Callable[[str], None] | None = None, confidence: float = 0.0) -> None:
        """``tree``: send EAGLE-2 dynamic draft trees instead of chains (not pipelined: what to draft
        next depends on which branch the target takes). ``confidence``: chains end where the
        drafter's probability falls below it (:class:`moaspec.drafters.proposers.DrafterProposer`)."""
        split_proposer(drafter)  # refuse an unsupported drafter now rather than mid-generation
        # a server may hold several MoA drafters' server halves: the client names its own
        self.fingerprint = drafter.fingerprint() if isinstance(drafter, MoADrafter) else None
        self.drafter, self.tokenizer, self.remote = drafter, tokenizer, remote
        self.eos, self.draft_len, self.fmt, self.max_draft, self.retry_every = eos, draft_len, fmt, max_draft, retry_every
        self.on_piece, self.on_event = on_piece, on_event
        self.pipeline = pipeline
        self.tree = tree
        self.confidence = check_confidence(confidence)
        self.lookup = min(lookup, max_draft)  # most drafts per prompt-lookup copy (0: the drafter alone)
        self.state_bytes = 0
        self.pipeline_hits = 0  # verifications whose next drafts were ready when the answer came
        self.cached_tokens = 0  # prompt tokens the server reused from its prompt cache, over every open
        self.carried_tokens = 0  # prompt tokens whose state this client held, so the server did not send it
        # the verified text and drafter state after the last generation: the next turn of a conversation
        # (which begins with it) starts from that state, and the server sends only the rest
        self._previous: tuple[list[int], SplitProposer] | None = None
        self._open_session: str | None = None  # the session to close if an answer ends in an error
        self._server_takes_have_state: bool | None = None  # asked once, when first needed

    # --- helpers ------------------------------------------------------------------------

    def _event(self, text: str) -> None:
        if self.on_event:
            self.on_event(text)

    def _take_state(self, answer: dict[str, Any], start: int) -> None:
        if isinstance(self.proposer, SplitIndependentProposer):  # state_kind "none": nothing comes
            return
        state = answer.get("state")
        if state is None:
            raise MoaspecError(f"the server sent no {self.proposer.state_kind} state for this session")
        if isinstance(self.proposer, SplitMoAProposer) and self.proposer.layers:
            if answer.get("layers") is None:
                raise MoaspecError("the server sent no K/V of the target layers this drafter runs")
            self.state_bytes += codec.payload_bytes(answer["layers"])
            self.proposer.receive_layers(start, codec.decode(answer["layers"]))
        self.state_bytes += codec.payload_bytes(state)
        self.proposer.receive(start, codec.decode(state))

    def _entries(self, answer: dict[str, Any], new: list[int]) -> list[TokenLogprob] | None:
        """The log-probability entries of ``new``, the tokens an answer verified (None when not asked)."""
        if self.sink.top is None:
            return None
        if answer.get("logprobs") is None:
            raise MoaspecError("the server sent no log-probabilities (a server older than the logprobs option)")
        try:
            return codec.decode_logprobs(answer["logprobs"], new)
        except codec.CodecError as exc:
            raise MoaspecError(f"the server's answer: {exc}") from None

    def _open(self, prompt: Sequence[int], budget: int, have: int = 0) -> tuple[int, list[TokenLogprob] | None]:
        """Open a session on ``prompt`` whose first ``have`` tokens' state the proposer already holds; the target's
        first token and its log-probability entry (when asked).

        A session reopened on part of the answer tells the server where the answer began, for the penalties.
        """
        layers = self.proposer.layers if isinstance(self.proposer, SplitMoAProposer) else 0
        have = min(have, len(prompt) - 1)
        sent = have if have > 0 and self.proposer.state_kind != "none" and self._takes_have_state() else 0
        answer_start = self.prompt_tokens if self.sampling.penalized and len(prompt) > self.prompt_tokens else None
        answer = self.remote.open(prompt, self.proposer.state_kind, self.fmt, budget, layers, self.fingerprint,
                                  self.sampling, have_state=sent, answer_start=answer_start, logprobs=self.sink.top)
        self.session = self._open_session = answer["session"]
        self.cached_tokens += int(answer.get("cached_tokens") or 0)  # servers before the prompt cache do not say
        self.carried_tokens += have if self.proposer.state_kind == "none" else sent  # no state travels for "none"
        self._take_state(answer, int(answer.get("state_start") or 0))  # from 0, what it holds is skipped
        first = int(answer["token"])
        return first, self._entries(answer, [first])

    def _takes_have_state(self) -> bool:
        if self._server_takes_have_state is None:
            self._server_takes_have_state = bool(self.remote.info().get("have_state"))
        return self._server_takes_have_state

    def _carry(self, prompt_ids: Sequence[int]) -> int:
        """Begin from the last generation's drafter state as far as its verified text begins ``prompt_ids``."""
        if self._previous is None or type(self._previous[1]) is not type(self.proposer):
            return 0
        tokens, old = self._previous
        n = common_prefix(tokens, prompt_ids, min(old.held(), len(prompt_ids) - 1))
        if n > 0:
            self.proposer.carry(old, n)  # type: ignore[arg-type]  # the same class, checked above
        return n

    # --- the loop -------------------------------------------------------------------------

    def run(self, prompt_ids: Sequence[int], config: GenerationConfig, context: int) -> SplitResult:
        """Generate one answer; the server is asked to verify on a helper thread (pipelining).

        A prompt that leaves no room in ``context`` is refused here, with :func:`check_fits`'s
        message (as ``generate`` words it), before a session is asked for.
        """
        check_fits(len(prompt_ids), context)
        self._open_session = None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="moaspec-verify") as self._pool:
            try:
                return self._run(prompt_ids, config, context)
            except BaseException:
                # an error or Ctrl-C mid-answer: free the session's place on the server now, not when it expires
                if self._open_session is not None:
                    self.remote.close(self._open_session)
                raise

    def _run(self, prompt_ids: Sequence[int], config: GenerationConfig, context: int) -> SplitResult:
        t0 = time.perf_counter()
        calls, sent, received = self.remote.calls, self.remote.bytes_sent, self.remote.bytes_received  # this run's: the rest
        self.pipeline_hits = self.state_bytes = self.cached_tokens = self.carried_tokens = 0
        self.sampling = config.sampling  # the server's, sent when the session opens
        self.prompt_tokens = len(prompt_ids)
        self.generator = None if config.sampling.greedy else config.sampling.generator()
        self.draft_sampling = config.sampling if config.sampling.greedy else replace(
            config.sampling, top_k=min(config.sampling.top_k or DRAFT_SUPPORT, DRAFT_SUPPORT))
        budget = min(config.max_new_tokens, context - len(prompt_ids))
        on_piece = self.on_piece
        self.sink = sink = TokenSink(self.tokenizer, config, self.eos, budget, None, on_piece=(
            (lambda text, drafted: on_piece(text, "draft" if drafted else "target")) if on_piece else None))
        self.proposer = split_proposer(self.drafter, self.confidence)
        self.view = _View(len(prompt_ids), min(context, len(prompt_ids) + budget + self.max_draft + 2))
        self.proposer.begin(self.view)  # type: ignore[arg-type]
        self.index = NgramIndex(min_ngram=MIN_NGRAM_BEFORE_DRAFTER)  # a drafter always stands behind it here
        try:
            first, entries = self._open(prompt_ids, budget, self._carry(prompt_ids))
        except ServerUnreachable as exc:
            raise MoaspecError(f"cannot reach the server to start: {exc}") from None
        ttft = time.perf_counter() - t0
        self.tokens = list(prompt_ids) + [first]  # verified tokens, then the unverified tail
        self.tail_q: list[Dist] = []  # what each token of the unverified tail was drawn from
        self.verified = len(self.tokens)
        self.accepted: list[int] = []
        offline_tokens = resyncs = 0
        offline: Detokenizer | None = None  # set while the server is unreachable
        drafts: list[int] | None = None  # drafted ahead during the last verification, ready to send
        dq: list[Dist] = []  # what each of them was drawn from
        sink.push([first], entries=entries)
        while not sink.done:
            if offline is None and self.tree is not None:
                try:
                    self._tree_round()
                except ServerUnreachable as exc:
                    self._event(f"server unreachable ({exc}); generating alone, text unverified")
                    offline = Detokenizer(self.tokenizer)
                continue
            if offline is None:
                if drafts is None:
                    drafts, dq = self._next_drafts([])
                in_flight = self._pool.submit(self.remote.verify, self.session, self.verified, drafts, dists=dq)
                # pipelining: while the server verifies, draft on as if it accepts every draft;
                # the first of these guesses the target's own token after them
                ahead, aq = self._next_drafts(drafts) if self.pipeline else ([], [])
                try:
                    answer = in_flight.result()
                except ServerUnreachable as exc:
                    self._event(f"server unreachable ({exc}); generating alone, text unverified")
                    offline = Detokenizer(self.tokenizer)
                    self._extend(drafts + ahead, offline, dq + aq)  # the unverifiable drafts start the unverified tail
                    offline_tokens += len(drafts) + len(ahead)
                    drafts = None
                    continue
                hit = int(answer["accepted"]) == len(drafts) and ahead[:1] == [int(answer["token"])]
                self._settle(drafts, answer)
                self.pipeline_hits += hit
                drafts, dq = (ahead[1:], aq[1:]) if hit and len(ahead) > 1 and not sink.done else (None, [])
                continue
            tail = self.tokens[self.verified:]
            room = budget - len(sink.tokens) - len(tail)
            finished = room <= 0 or any(t in self.eos for t in tail)
            if not finished:  # extend the unverified tail with the drafter alone
                alone, q = self._draft(max(1, min(self.retry_every, room, self.view.capacity - len(self.tokens) - 1)))
                self._extend(alone, offline, q)
                offline_tokens += len(alone)
            if self._resync():
                resyncs += 1
                offline = None
            elif finished:
                break  # still no server and nothing left to generate: end with an unverified tail
        text = sink.close()
        unverified: list[int] = []
        if offline is not None:
            tail = self.tokens[self.verified:]
            cut = next((i for i, t in enumerate(tail) if t in self.eos), len(tail))
            unverified = tail[: min(cut, budget - len(sink.tokens))]
            text += self.tokenizer.decode(unverified, skip_special_tokens=True)
        self.remote.close(self.session)
        self._open_session = None
        self._previous = (self.tokens[: self.verified], self.proposer)
        finish = sink.finish or ("eos" if any(t in self.eos for t in self.tokens[self.verified:]) else "length")
        return SplitResult(
            token_ids=sink.tokens + unverified, text=text, finish_reason=finish, prompt_tokens=len(prompt_ids),
            total_s=time.perf_counter() - t0, ttft_s=ttft, server_calls=self.remote.calls - calls,
            bytes_sent=self.remote.bytes_sent - sent, bytes_received=self.remote.bytes_received - received,
            state_bytes=self.state_bytes,
            accepted_lengths=self.accepted, unverified=len(unverified), offline_tokens=offline_tokens, resyncs=resyncs,
            pipeline_hits=self.pipeline_hits, cached_tokens=self.cached_tokens, carried_tokens=self.carried_tokens,
            logprobs=sink.logprobs,
        )

    def _extend(self, drafts: list[int], shown: Detokenizer, dists: list[Dist]) -> None:
        """Append drafts (drawn from ``dists``) to the unverified tail (and show them as such)."""
        self.tokens += drafts
        self.tail_q += dists
        self.proposer.commit(len(self.tokens) - 1)
        if self.on_piece and (text := shown.push(drafts)):
            self.on_piece(text, "unverified")

    def _room(self, n: int, ahead: int) -> int:
        """At most ``n`` drafts, ``ahead`` tokens past the newest, within the budget and the caches."""
        left = self.sink.budget - len(self.sink.tokens) - ahead
        return max(0, min(n, left, self.view.capacity - len(self.tokens) - ahead - 1))

    def _next_drafts(self, in_flight: list[int]) -> tuple[list[int], list[Dist]]:
        """The drafts to send next, continuing ``in_flight`` (drafts sent but not verified yet), and
        what each was drawn from.

        After drafts in flight, one more is drafted: it guesses the target's own token.
        A prompt-lookup copy goes first where one is found, the drafter's chain otherwise.
        """
        guess = 1 if in_flight else 0
        if self.lookup:
            self.index.update(self.tokens[: self.verified])  # only verified tokens are indexed: they never change
            n = self._room(self.lookup + guess, len(in_flight) + guess)
            copied = self.index.match(self.tokens + in_flight, n) if n > 0 else []
            if copied:
                return copied, [None] * len(copied)  # copies are point masses
        return self._draft(self._room(self.draft_len + guess, len(in_flight) + guess), in_flight)

    def _draft(self, n: int, after: list[int] | None = None) -> tuple[list[int], list[Dist]]:
        """``n`` drafts by the drafter, continuing the tokens and then ``after`` (drafts not verified yet),
        and the distributions they were drawn from (point masses when greedy)."""
        if n <= 0:
            return [], []
        tokens = self.tokens + (after or [])
        self.view.length = len(tokens) - 1
        proposal = self.proposer.propose(tokens, n, self.draft_sampling, self.generator)
        drafts = proposal.tokens.tolist()
        if proposal.probs is None:
            return drafts, [None] * len(drafts)
        return drafts, [_sparse(row) for row in proposal.probs]

    def _tree_round(self) -> None:
        """Grow a draft tree from the newest token, have it verified, keep the accepted branch."""
        self.view.length = len(self.tokens) - 1
        assert self.tree is not None
        room = self.view.capacity - len(self.tokens)
        shape = TreeShape(max(1, self._room(self.tree.depth, 0)), self.tree.top_k,
                          max(1, min(self.tree.total, self.max_draft + 1, room)))
        tree = self.proposer.propose_tree(self.tokens, shape)
        if self.lookup:
            self.index.update(self.tokens[: self.verified])
            n = self._room(self.lookup, 0)
            copied = self.index.match(self.tokens, n) if n > 0 else []
            if copied and len(tree.parents) - 1 + len(copied) <= self.max_draft:
                tree = tree.graft(copied)
        try:
            answer = self.remote.verify(self.session, self.verified, tree.tokens[1:].tolist(), parents=tree.parents[1:])
        except ServerUnreachable:
            self.proposer.commit(len(self.tokens) - 1)  # forget the tree's nodes: drafting goes on alone from here
            raise
        path = [int(i) for i in answer.get("path", [])]
        if any(not 0 < node < len(tree.parents) or tree.parents[node] != prev for node, prev in zip(path, [0, *path])):
            raise MoaspecError(f"the server accepted the path {path}, which is not a branch of the tree it was sent")
        self._keep(answer, [int(tree.tokens[i]) for i in path] + [int(answer["token"])], len(path), [], path)

    def _settle(self, chunk: list[int], answer: dict[str, Any]) -> None:
        """The server verified ``chunk`` (the drafts after the verified tokens): keep what it accepted.

        Drafted tokens beyond ``chunk`` (an unverified tail) survive when the target's own
        token agrees with the next one of them.
        """
        a, token = int(answer["accepted"]), int(answer["token"])
        tail = self.tokens[self.verified:]
        keeps_tail = a == len(chunk) and len(tail) > a and tail[a] == token
        self._keep(answer, chunk[:a] + [token], a, tail[a + 1:] if keeps_tail else [],
                   tail_q=self.tail_q[a + 1:] if keeps_tail else [])

    def _keep(self, answer: dict[str, Any], new: list[int], drafted: int, tail: list[int],
              path: list[int] | None = None, tail_q: list[Dist] | None = None) -> None:
        """``new`` (``drafted`` drafts, then the target's token) is verified; ``tail`` (drawn from
        ``tail_q``) stays unverified after it.

        ``path``: the tree nodes ``new`` came from, whose drafter entries are kept.
        """
        self._take_state(answer, self.verified - 1)
        self.tokens[self.verified:] = new + tail
        self.tail_q = list(tail_q or [])
        self.verified += len(new)
        self.accepted.append(len(new))
        self.proposer.commit(len(self.tokens) - 1, path)
        self.sink.push(new, drafted=drafted, entries=self._entries(answer, new))

    def _resync(self) -> bool:
        """Verify the unverified tail if the server answers now; False while it is still unreachable."""
        piece = RESYNC_FIRST_PIECE
        try:
            while not self.sink.done and self.tokens[self.verified:]:
                chunk = self.tokens[self.verified:][: min(piece, self.max_draft)]
                piece *= 2  # the next piece exists only if this one is kept whole (a rejection drops the rest)
                try:
                    self._settle(chunk, self.remote.verify(self.session, self.verified, chunk, retries=0,
                                                           dists=self.tail_q[: len(chunk)]))
                except ServerRefused as exc:
                    if exc.status not in (404, 409):
                        raise
                    # the session expired, or a lost answer advanced it: open a new one on the verified text
                    if exc.status == 409:  # the old one is still alive on the server: free its place
                        self.remote.close(self.session)
                    first, entries = self._open(self.tokens[: self.verified],
                                                max(1, self.sink.budget - len(self.sink.tokens)), self.proposer.held())
                    agrees = chunk[0] == first
                    self.tokens[self.verified:] = [first] + (self.tokens[self.verified + 1:] if agrees else [])
                    self.tail_q = self.tail_q[1:] if agrees else []
                    self.verified += 1
                    self.proposer.commit(len(self.tokens) - 1)
                    self.sink.push([first], drafted=int(agrees), entries=entries)
        except ServerUnreachable:
            return False
        self._event("server reachable again: unverified text checked; the text from here on is verified")
        return True
