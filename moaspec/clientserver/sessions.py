"""The server's half of client–server speculative decoding: target sessions, no HTTP.

A session holds one conversation's target KV cache. Opening it prefills the prompt
and returns the target's first token; each verification scores a client's draft in
one target forward and returns how many drafts were accepted, the target's own next
token, and the *state* of the newly verified tokens — for MoA the Layer
Self-Attention memory entries (one d-sized vector per token, computed here next to
the target's K/V of every layer, so all layers' K/V never travel); for EAGLE the
target's final hidden states. A client running the target's last N layers itself (a
MoA drafter with Target Layer Inference) also asks for those layers' K/V of the newly
verified tokens (``layers``, 2·kv_dim values per token and layer), which its copies of
the layers attend to. Requests are checked before any work; a retried
verification (its response was lost) gets the same answer again instead of
advancing twice.

With a :class:`~moaspec.decoding.prefill.PromptCache` (``moaspec serve`` shares its own
between the OpenAI routes and these sessions), a session's prompt is read only after the
longest prefix another conversation already read, and a session that ends (closed, or
expired) leaves its whole verified text there: the next turn of a conversation, or a
client that reopens after its session expired, reads only what is new.

A session decodes greedily, or samples with the temperature, top-k and top-p it was
opened with. Sampling, a chain's draft may come with the distribution the client drew
it from (``dists``: at most ``MAX_SUPPORT`` tokens with their probabilities, as a
client drafting from its top tokens draws them): it is verified by speculative
sampling, accepted with probability min(1, p/q). A draft without one — a prompt-lookup
copy, a tree's node, a greedy draft — is verified as a point mass: accepted with the
target's probability of it, else the token is drawn from the target's distribution
without it, which keeps the target's distribution whatever chose the draft. Either
way the tokens follow the target's distribution exactly.

A session may also be opened with OpenAI's presence and frequency penalties and a logit
bias (greedy or sampling): each verified row's logits are adjusted by the answer so far
and the drafts on its path, as on one device (:func:`~moaspec.decoding.sampling.adjust_rows`).
The answer begins after the prompt unless ``answer_start`` says it began earlier (a session
reopened on a partly written answer). With ``logprobs`` every answer carries the target's
log-probability of each newly verified token and its likeliest alternatives.

A session costs mostly its target K/V: 2 · layers · kv_heads · head_dim values per token (46 KB
in fp32 for SmolLM2-135M). Its cache starts with room for the prompt and one verification and
doubles as the session grows, up to the prompt plus the new tokens it was opened for (the
``capacity`` an open answers): a 2-token prompt costs about 3 MB, not the 92 MiB of room for
2,048 new tokens. Idle sessions expire after ``ttl_s`` on a timer of their own, whether or not
another request comes.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moaspec.batching import ForwardBatcher
from moaspec.chat import outside_vocabulary
from moaspec.clientserver import codec
from moaspec.cores import Cores, prefill_threads, working
from moaspec.decoding.generation import MAX_TOP_LOGPROBS, token_logprobs
from moaspec.decoding.prefill import Prefill, PromptCache
from moaspec.decoding.sampling import (
    SamplingParams,
    adjust,
    adjust_rows,
    answer_counts,
    count_tokens,
    probabilities,
    select_token,
)
from moaspec.decoding.tree import DraftTree
from moaspec.decoding.verify import verify_greedy, verify_sampling, verify_tree
from moaspec.drafters.moa import MoADrafter
from moaspec.errors import MoaspecError, shown
from moaspec.heap import release_free_memory
from moaspec.models.kv_cache import KVCache
from moaspec.models.loading import LoadedModel
from moaspec.models.transformer import Call, ChunkCallback, tree_mask

MAX_SUPPORT = 64  # most tokens in one draft's distribution (the client sends its top 32)

# (target cache, first position, end position, the target's final hidden states of those positions) → [T, d]
StateFn = Callable[[KVCache, int, int, torch.Tensor], torch.Tensor]


class SessionError(Exception):
    """A request the store refuses: ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def final_states(cache: KVCache, start: int, end: int, hidden: torch.Tensor) -> torch.Tensor:
    """EAGLE's state: the target's final hidden states."""
    return hidden


def last_layers_kv(cache: KVCache, start: int, end: int, layers: int) -> torch.Tensor:
    """The last ``layers`` layers' K/V of positions ``start..end-1``: ``[T * layers, 2 * kv_dim]``, token-major.

    One row per (token, layer), K heads then V heads, so int8 gives each its own scale.
    """
    kv = cache.token_kv(start, end)[0, :, cache.num_layers - layers :]  # [T, layers, 2 * kv_dim]
    return kv.reshape(-1, kv.shape[-1])


@dataclass(frozen=True)
class Limits:
    max_sessions: int = 32
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 2048  # per session, over its whole life
    max_draft: int = 64  # tokens per verification (an offline client's tail is sent in pieces)
    ttl_s: float = 300.0  # idle sessions expire after this long

    @property
    def sweep_s(self) -> float:
        """How often expired sessions are looked for: a session is freed within a quarter TTL of expiring."""
        return min(max(self.ttl_s / 4, 0.05), 10.0)


@dataclass
class Session:
    id: str
    cache: KVCache
    tokens: list[int]  # prompt + verified tokens; the newest has no K/V in the cache yet
    state: StateFn | None  # what this session's client needs per verified token
    fmt: str
    layers: int  # the last layers whose K/V the client asked for (Target Layer Inference)
    expires: float
    limit: int  # prompt + the new tokens the session was opened for: no verification starts past it
    room: int  # the positions its cache may grow to (what the open answered as its capacity)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None  # seeded from sampling.seed; None when greedy
    lock: threading.Lock = field(default_factory=threading.Lock)
    last: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # ((verified, draft, parents, dists), answer) for retries
    # kept only for a prompt cache, which stores them when the session ends, in pieces of the cached positions:
    hidden: list[torch.Tensor] = field(default_factory=list)  # the final hidden states
    memory: str | None = None  # the name of the prompt cache's extra for this session's MoA memory entries
    entries: list[torch.Tensor] = field(default_factory=list)  # those entries
    counts: torch.Tensor | None = None  # how often each token occurs in the answer, with penalties only
    top: int | None = None  # log-probabilities: None (not asked), or how many alternatives per token

    def scored(self, logits: torch.Tensor, tokens: Sequence[int]) -> dict[str, Any]:
        """The answer's ``logprobs`` for newly verified ``tokens`` from the logits that scored them (when asked)."""
        return {} if self.top is None else {"logprobs": codec.encode_logprobs(token_logprobs(logits, tokens, self.top))}


class SessionStore:
    """Target sessions for remote drafters, with limits and expiry."""

    def __init__(self, target: LoadedModel, moa: MoADrafter | Sequence[MoADrafter] | None = None,
                 limits: Limits = Limits(), prompt_cache: PromptCache | None = None, cores: Cores | None = None,
                 batcher: ForwardBatcher | None = None) -> None:
        """``moa``: the MoA drafters whose server half (LSA) this server runs for remote clients.

        Several let clients with different drafters (N = 0 and N = 1, or an old and a new
        version during a rollout) share one server; each names its own when it opens a session.
        ``prompt_cache``: where sessions begin from what was read before, and leave what they verified.
        ``cores``: how the CPU's cores are shared with other work (a prefill alone gets them all).
        ``batcher``: runs the verifications' target forwards that wait at the same time as one (sessions
        verified together read the weights once); without it each verification runs its own.
        """
        self.target = target
        moas = [] if moa is None else [moa] if isinstance(moa, MoADrafter) else list(moa)
        self._moas = {d.fingerprint(): d for d in moas}
        self._kinds = ["eagle", "none"] + (["moa"] if moas else [])
        self.width = target.cfg.hidden_size
        self.limits = limits
        self.prompt_cache = prompt_cache
        self.cores = cores
        self.batcher = batcher
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._sweeper: threading.Thread | None = None  # runs while sessions are held

    def _sweep(self) -> None:
        """Expire idle sessions every ``sweep_s`` until none is held (the next open starts this again)."""
        while True:
            time.sleep(self.limits.sweep_s)
            self._expire()
            with self._lock:
                if not self._sessions:
                    self._sweeper = None
                    return

    def info(self) -> dict[str, Any]:
        lim = self.limits
        return {"states": sorted(self._kinds), "state_width": self.width, "formats": list(codec.FORMATS),
                "vocab_size": self.target.cfg.vocab_size, "fingerprint": self.target.fingerprint,
                "moa_drafters": list(self._moas), "max_target_layers": self.target.cfg.num_layers - 1,
                "max_sessions": lim.max_sessions, "max_prompt_tokens": lim.max_prompt_tokens,
                "max_new_tokens": lim.max_new_tokens, "max_draft": lim.max_draft, "ttl_s": lim.ttl_s,
                "open_sessions": len(self._sessions), "have_state": True}  # opens take have_state (older servers: no)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [sid for sid, s in self._sessions.items() if s.expires < now]
            ended = [self._sessions.pop(sid) for sid in expired]
        while ended:
            self._remember(ended.pop())  # a client that comes back after this reopens on its verified text
        if expired:
            release_free_memory()

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        bad = outside_vocabulary(ids, self.target.cfg.vocab_size)
        if bad is not None:
            raise SessionError(400, f"{what} holds token id {shown(bad)}, outside the vocabulary [0, {self.target.cfg.vocab_size})")

    def _state_of(self, s: Session, start: int, end: int, hidden: torch.Tensor, known: torch.Tensor | None = None,
                  held: int = 0) -> dict[str, Any]:
        """The answer's ``state`` (and ``layers``) for the newly verified positions ``start..end-1``, but the
        first ``held`` of them, which the client already holds (``state_start`` says where they begin).

        ``known``: MoA memory entries of the first of them, from the prompt cache (LSA over a
        3,100-token prompt takes 1.3 s on one CPU thread). Rows the client holds are computed
        only when the prompt cache is to keep them.
        """
        fn, state, send = s.state, None, start + held
        if fn is not None:
            first = start if s.memory is not None else send  # the cache keeps every row; the client needs its rest
            done = first if known is None else max(first, start + len(known))
            state = fn(s.cache, done, end, hidden[done - start:])
            if known is not None and done > first:
                state = torch.cat([known[first - start:].to(state.dtype), state])
            if s.memory is not None:
                s.entries.append(state)  # every row, for the prompt cache, whatever the client is sent
            state = state[send - first:]
        out: dict[str, Any] = {"state": None if state is None else codec.encode(state, s.fmt), "state_start": send}
        if s.layers:
            out["layers"] = codec.encode(last_layers_kv(s.cache, send, end, s.layers), s.fmt)
        return out

    @torch.inference_mode()
    def open(self, prompt: Sequence[int], kind: str = "moa", fmt: str = "fp16",
             max_new_tokens: int | None = None, layers: int = 0, drafter: str | None = None,
             sampling: SamplingParams = SamplingParams(), on_prefill: ChunkCallback | None = None,
             have_state: int = 0, answer_start: int | None = None, logprobs: int | None = None) -> dict[str, Any]:
        """Prefill ``prompt``; answer the session id, the first token and the prompt's state.

        ``layers``: how many of the target's last layers' K/V to send with every state;
        ``drafter``: the fingerprint of the client's MoA drafter (may be left out when the
        server holds only one); ``sampling``: how the session picks the target's tokens
        (greedy by default); ``on_prefill``: follows the prefill chunk by chunk, and may raise
        to abandon it (the session is then dropped); ``have_state``: the client already holds the
        state of the prompt's first tokens (a conversation's next turn, or a session reopened after
        it expired), so only the rest is sent: for MoA over fp16, 1,152 bytes per token saved;
        ``answer_start``: where in the prompt the answer the penalties count began (default: after it);
        ``logprobs``: answer with each verified token's log-probability and this many alternatives.
        """
        lim = self.limits
        if not prompt:
            raise SessionError(400, "the prompt is empty")
        context = self.target.cfg.max_position_embeddings
        if len(prompt) > lim.max_prompt_tokens or len(prompt) >= context:
            raise SessionError(413, f"the prompt has {len(prompt)} tokens; this server takes at most "
                                    f"{min(lim.max_prompt_tokens, context - 1)}")
        if kind not in self._kinds:
            raise SessionError(400, f"this server sends {', '.join(sorted(self._kinds))} states, not {kind!r}")
        moa = self._moa_half(drafter) if kind == "moa" else None
        state = moa[1].memory_entries if moa is not None else final_states if kind == "eagle" else None
        if fmt not in codec.FORMATS:
            raise SessionError(400, f"state_format must be one of {', '.join(codec.FORMATS)}")
        if not 0 <= layers < self.target.cfg.num_layers:
            raise SessionError(400, f"target_layers must be in 0..{self.target.cfg.num_layers - 1}, got {layers}")
        self._check_ids(prompt, "the prompt")
        if not 0 <= have_state < len(prompt):
            raise SessionError(400, f"have_state must be in 0..{len(prompt) - 1} (the prompt's last token always gets "
                                    f"its state), got {have_state}")
        if answer_start is not None and not 0 <= answer_start <= len(prompt):
            raise SessionError(400, f"answer_start must be in 0..{len(prompt)} (a position in the prompt), got {answer_start}")
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise SessionError(400, f"logprobs must be in 0..{MAX_TOP_LOGPROBS} (alternatives per token), got {logprobs}")
        try:
            sampling.check_vocabulary(self.target.cfg.vocab_size)
        except MoaspecError as exc:
            raise SessionError(400, str(exc)) from None
        budget = min(max_new_tokens or lim.max_new_tokens, lim.max_new_tokens, context - len(prompt))
        self._expire()
        room = min(len(prompt) + budget + lim.max_draft + 1, context)
        with self._lock:
            if len(self._sessions) >= lim.max_sessions:
                raise SessionError(503, f"the server holds its maximum of {lim.max_sessions} sessions; retry later")
            sid = secrets.token_urlsafe(16)
            cache = self.target.model.new_cache(min(len(prompt) + lim.max_draft + 1, room))  # grown as it is used
            s = Session(sid, cache, list(prompt), state, fmt, layers, time.monotonic() + lim.ttl_s, len(prompt) + budget,
                        room, sampling, None if sampling.greedy else sampling.generator(self.target.model.device), top=logprobs,
                        counts=answer_counts(sampling, self.target.cfg.vocab_size, self.target.model.device,
                                             prompt[len(prompt) if answer_start is None else answer_start:]))
            self._sessions[sid] = s
            if self._sweeper is None:
                self._sweeper = threading.Thread(target=self._sweep, name="moaspec-sessions", daemon=True)
                self._sweeper.start()
        known = None
        if self.prompt_cache is not None and moa is not None:
            s.memory = f"moa-memory:{moa[0]}"
        try:
            with s.lock, working(self.cores):
                logits, hidden, reused = Prefill(on_prefill, self.prompt_cache, prefill_threads(self.cores))(
                    self.target.model, prompt, cache)
                first = select_token(adjust(logits, sampling, s.counts), sampling, s.generator)
                s.tokens.append(first)
                count_tokens(s.counts, [first])
                if self.prompt_cache is not None and s.memory is not None and reused:
                    known = self.prompt_cache.extra(s.memory, prompt[:reused])
                first_state = self._state_of(s, 0, len(prompt), hidden, known, have_state)
                if self.prompt_cache is not None:
                    s.hidden.append(hidden)
        except BaseException:
            with self._lock:  # a failed prefill must not hold a place until its TTL
                self._sessions.pop(sid, None)
            raise
        return {"session": sid, "token": first, "verified": len(s.tokens), **first_state, **s.scored(logits[None], [first]),
                "capacity": room, "expires_in_s": lim.ttl_s, "cached_tokens": reused}

    def _moa_half(self, fingerprint: str | None) -> tuple[str, MoADrafter]:
        """The MoA drafter a client names (by ``fingerprint``; none: the only one held), and its fingerprint."""
        if fingerprint is None:
            if len(self._moas) > 1:
                raise SessionError(400, "this server holds several MoA drafters: name yours (drafter: its fingerprint, "
                                        f"one of {', '.join(self._moas)})")
            return next(iter(self._moas.items()))
        if fingerprint not in self._moas:
            raise SessionError(400, f"this server does not hold the MoA drafter {fingerprint} (it holds "
                                    f"{', '.join(self._moas)}): start it with that drafter too")
        return fingerprint, self._moas[fingerprint]

    def _get(self, sid: str) -> Session:
        self._expire()
        with self._lock:
            s = self._sessions.get(sid)
        if s is None:
            raise SessionError(404, "unknown or expired session; open a new one")
        return s

    def _draft_probs(self, draft: Sequence[int], dists: Sequence[tuple[Sequence[int], Sequence[float]] | None] | None,
                     device: torch.device) -> torch.Tensor:
        """The dense ``[T, V]`` distributions a chain's drafts were drawn from: each given one as
        (token ids, probabilities), a point mass on the draft where none is given (or ``dists`` is None)."""
        vocab = self.target.cfg.vocab_size
        dists = [None] * len(draft) if dists is None else dists
        if len(dists) != len(draft):
            raise SessionError(400, f"dists must give one entry (or null) per draft token: {len(draft)}, not {len(dists)}")
        q = torch.nn.functional.one_hot(torch.tensor(list(draft), dtype=torch.long), vocab).float()
        for i, dist in enumerate(dists):
            if dist is None:
                continue
            ids, probs = dist
            if not 0 < len(ids) == len(probs) <= MAX_SUPPORT:
                raise SessionError(400, f"dists[{i}] must pair 1..{MAX_SUPPORT} token ids with as many probabilities")
            self._check_ids(ids, f"dists[{i}]")
            row = torch.tensor(list(probs), dtype=torch.float32)
            if len(set(ids)) != len(ids) or not bool(torch.isfinite(row).all() and (row > 0).all()) or float(row.sum()) > 1.001:
                raise SessionError(400, f"dists[{i}] must hold distinct token ids with positive probabilities summing to at most 1")
            if draft[i] not in ids:
                raise SessionError(400, f"dists[{i}] gives draft token {draft[i]} no probability: it cannot have been drawn from it")
            q[i].zero_()
            q[i, torch.tensor(list(ids), dtype=torch.long)] = row
        return q.to(device)

    @torch.inference_mode()
    def verify(self, sid: str, verified: int, draft: Sequence[int], parents: Sequence[int] | None = None,
               dists: Sequence[tuple[Sequence[int], Sequence[float]] | None] | None = None) -> dict[str, Any]:
        """Score ``draft``, which continues the session's ``verified`` tokens: a chain, or a tree.

        A tree gives each draft node's ``parents`` entry: 0 for the newest verified token
        (the root), ``j`` for ``draft[j - 1]``, always an earlier node. The whole tree is
        verified in one forward under a tree mask; the answer's ``path`` names the accepted
        nodes, and only they stay in the cache. ``dists``: for a sampling session's chain, the
        distribution each draft was drawn from (see the module's docstring).
        """
        s = self._get(sid)
        if len(draft) > self.limits.max_draft:
            raise SessionError(413, f"the draft has {len(draft)} tokens; at most {self.limits.max_draft} per verification")
        self._check_ids(draft, "the draft")
        if parents is not None and (len(parents) != len(draft) or any(not 0 <= p <= i for i, p in enumerate(parents))):
            raise SessionError(400, "parents must give one earlier node per draft token: 0 for the root, j for draft[j - 1]")
        if dists is not None and (parents is not None or s.sampling.greedy):
            raise SessionError(400, "dists go with a sampling session's chain only (a tree's nodes, and greedy "
                                    "verification, need none)")
        # a sampling session's chain: what each draft was drawn from (point masses where not given)
        q = None if s.sampling.greedy or parents is not None else self._draft_probs(draft, dists, self.target.model.device)
        key = (verified, tuple(draft), None if parents is None else tuple(parents),
               None if dists is None else repr(dists))
        with s.lock, working(self.cores):
            s.expires = time.monotonic() + self.limits.ttl_s
            if s.last is not None and s.last[0] == key:
                return s.last[1]  # a retry of the last request: same answer, no second advance
            if verified != len(s.tokens):
                raise SessionError(409, f"the session has {len(s.tokens)} verified tokens, the request assumes {verified}")
            need = s.cache.length + 1 + len(draft)
            if len(s.tokens) >= s.limit or need > s.room:
                raise SessionError(400, "the session has used its token budget (the max_new_tokens it was opened with, "
                                        "or the context window); open a new one")
            if need > s.cache.capacity:
                grown = self.target.model.new_cache(min(max(need, 2 * s.cache.capacity), s.room))
                grown.load_prefix(s.cache.keys, s.cache.values, s.cache.length)
                s.cache = grown
            cache = s.cache
            start, device = cache.length, self.target.model.device
            nodes = torch.tensor([s.tokens[-1], *draft], dtype=torch.long)
            greedy, gen = s.sampling.greedy, s.generator
            if parents is None:
                raw, hidden = self._forward(Call(nodes[None].to(device), cache))
                logits = adjust_rows(raw, s.sampling, s.counts, nodes.to(device))
                drafts = nodes[1:].to(device)
                if greedy:
                    verdict = verify_greedy(drafts, logits)
                else:
                    assert q is not None
                    verdict = verify_sampling(drafts, q, probabilities(logits, s.sampling), gen)
                path, token = list(range(1, verdict.accepted + 1)), verdict.next_token
            else:
                tree = DraftTree.from_parents(nodes.tolist(), [-1, *parents])
                ancestors = tree.ancestors().to(device)
                raw, hidden = self._forward(Call(nodes[None].to(device), cache, start + tree.depths.to(device),
                                         tree_mask(start, ancestors)))
                logits = adjust_rows(raw, s.sampling, s.counts, tree.tokens.to(device), ancestors)
                scores = logits if greedy else probabilities(logits, s.sampling)
                path, token = verify_tree(tree.tokens, tree.parents, scores, greedy, gen)
            kept = [0, *path]
            cache.compact(start, torch.tensor(kept))
            if self.prompt_cache is not None:
                s.hidden.append(hidden[kept])
            new = [int(nodes[i]) for i in path] + [token]
            s.tokens += new
            count_tokens(s.counts, new)
            answer = {"accepted": len(path), "token": token, "verified": len(s.tokens),
                      **({"path": path} if parents is not None else {}),
                      **self._state_of(s, start, cache.length, hidden[kept]), **s.scored(raw[kept], new)}
            s.last = (key, answer)
            return answer

    def _forward(self, call: Call) -> tuple[torch.Tensor, torch.Tensor]:
        """A verification's target forward (with the batcher, together with the others waiting): the logits
        ``[T, V]`` and final hidden states ``[T, d]`` of the call's tokens, every one of them."""
        if self.batcher is not None:
            out = self.batcher.forward(call)
        else:
            out = self.target.model(call.tokens, call.cache, call.positions, call.mask)
        assert out.logits is not None, "a forward gives every position's logits unless told otherwise"
        return out.logits[0], out.hidden[0]

    def close(self, sid: str) -> None:
        with self._lock:
            s = self._sessions.pop(sid, None)
        if s is None:
            raise SessionError(404, "unknown or expired session")
        self._remember(s)
        del s
        release_free_memory()  # the session's cache is freed by now, unless a verification still runs on it

    def _remember(self, s: Session) -> None:
        """Leave an ended session's verified text in the prompt cache (about 80 ms for 4,096 tokens on a CPU).

        Its cache's positions are those of ``s.tokens`` but the newest (which a verification
        would have written next); none were rewritten since they were verified.
        """
        if self.prompt_cache is not None:
            with s.lock:  # a verification still under way (its client gave up on it) finishes first
                n = min(s.cache.length, sum(h.shape[0] for h in s.hidden))  # a verification that failed half-way adds none
                extras = {s.memory: torch.cat(s.entries)[:n]} if s.memory is not None else None
                self.prompt_cache.store(s.tokens[:n], s.cache, torch.cat(s.hidden)[:n], extras)
