"""Reading a prompt into the target's cache: chunk by chunk, reusing what recent prompts already read.

A chat's next turn begins with the whole conversation so far, so a server that keeps the
keys/values (and final states) of the prompts it has just read, and of the answers it wrote
to them, can start the next turn's prefill where they end: only the new message is read. On a
2-core CPU server (one thread per request) a conversation that began with a 3,000-token
document took 9.4–9.8 s before each answer, and 0.26–0.32 s with the cache
(docs/experiments/2026-11-29-next-turns-prompt-cache.md, "Reusing the prompts a server has
read" and "Next turns keep the answer too"). Reused K/V are exactly those of the earlier
forward; the positions after them are
computed as a chunked prefill computes them (each chunk attending to the cache before it), so
the result equals reading the whole prompt up to the order of floating-point sums, as
chunking itself does.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from moaspec.decoding.proposer import Resumable
from moaspec.errors import MoaspecError
from moaspec.models.kv_cache import KVCache
from moaspec.models.transformer import ChunkCallback, Transformer


@dataclass(frozen=True)
class _Entry:
    keys: torch.Tensor  # [layers, 1, kv heads, T, head dim], as the cache holds them
    values: torch.Tensor
    hidden: torch.Tensor  # [T, d]: the final states the drafter begins from
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # name → rows of the first positions (see extra())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.hidden, *self.extras.values()))


class PromptCache:
    """The K/V and final states of recent prompts (with their answers), least recently used first out, within
    ``max_bytes``.

    Thread-safe: a server's decoding threads share one. Prompts shorter than ``min_tokens``
    are neither stored nor reused (reading them costs less than keeping them).
    """

    def __init__(self, max_bytes: int, min_tokens: int = 256) -> None:
        if not (isinstance(max_bytes, int) and isinstance(min_tokens, int) and max_bytes >= 0 and min_tokens >= 1):
            raise MoaspecError(f"a prompt cache needs whole numbers max_bytes >= 0 and min_tokens >= 1, got "
                               f"max_bytes={max_bytes!r}, min_tokens={min_tokens!r}")
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def longest(self, prompt: Sequence[int]) -> tuple[int, _Entry | None]:
        """The most leading tokens of ``prompt`` a stored prompt shares (at most all but its last), and that entry."""
        best, found = 0, None
        limit = len(prompt) - 1  # the last prompt token is always read: its logits pick the first new token
        with self._lock:
            for tokens, entry in self._entries.items():
                n = common_prefix(tokens, prompt, limit)
                if n > best:
                    best, found = n, (tokens, entry)
            if found is None or best < self.min_tokens:
                return 0, None
            self._entries.move_to_end(found[0])
            return best, found[1]

    def extra(self, name: str, prompt: Sequence[int]) -> torch.Tensor | None:
        """The most leading rows of the extra ``name`` stored for positions whose tokens begin ``prompt``, if any.

        What a reader derives from the K/V position by position (a MoA server's memory entries)
        is as valid as the K/V themselves, so whoever reuses them can reuse it too.
        """
        best, found = 0, None
        with self._lock:
            for tokens, entry in self._entries.items():
                rows = entry.extras.get(name)
                n = 0 if rows is None else common_prefix(tokens, prompt, rows.shape[0])
                if n > best:
                    best, found = n, rows
        return None if found is None else found[:best]

    def store(self, prompt: Sequence[int], cache: KVCache, hidden: torch.Tensor,
              extras: Mapping[str, torch.Tensor] | None = None) -> None:
        """Keep ``prompt``'s K/V (the first ``len(prompt)`` positions of ``cache``), final states ``[T, d]``,
        and ``extras`` (name → rows of the first positions, at most ``T``; see :meth:`extra`)."""
        T = len(prompt)
        if T < self.min_tokens:
            return
        entry = _Entry(cache.keys[:, :, :, :T].clone(), cache.values[:, :, :, :T].clone(), hidden[:T].clone(),
                       {name: rows[:T].clone() for name, rows in (extras or {}).items()})
        if entry.nbytes > self.max_bytes:
            return
        key = tuple(prompt)
        with self._lock:
            for tokens in [t for t in self._entries if len(t) <= T and key[: len(t)] == t]:
                # a prefix of this prompt: everything it could give, this one gives, but the extras it alone has
                old = self._entries.pop(tokens)
                entry.extras.update({k: v for k, v in old.extras.items() if k not in entry.extras})
            self._entries[key] = entry
            total = sum(e.nbytes for e in self._entries.values())
            while total > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                total -= old.nbytes


class SharedRead:
    """One prompt read once for several generations of it (a request's ``n`` choices, which start together, so
    none would find it in a :class:`PromptCache`): the first to arrive reads it, the others wait and copy what it
    read. The copy is dropped once ``users`` generations have taken it (or with this object)."""

    def __init__(self, users: int) -> None:
        self._lock = threading.Lock()
        self._users = users
        self._read: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __call__(self, prompt_ids: Sequence[int], cache: KVCache,
                 read: Callable[[], tuple[torch.Tensor, torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """What ``read()`` returns for the first caller; for the others, its K/V copied into their empty ``cache``
        (every prompt position counted as reused)."""
        T = len(prompt_ids)
        with self._lock:
            self._users -= 1
            if self._read is None:  # the first (or the first after one abandoned its read)
                logits, hidden, reused = read()
                if self._users > 0:
                    self._read = (cache.keys[:, :, :, :T].clone(), cache.values[:, :, :, :T].clone(), logits, hidden)
                return logits, hidden, reused
            keys, values, logits, hidden = self._read
            if self._users <= 0:
                self._read = None
        cache.load_prefix(keys, values, T)
        return logits, hidden, T


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """How many first tokens ``a`` and ``b`` share (at most ``limit``)."""
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass(frozen=True)
class Prefill:
    """How a generation reads its prompt: ``on_chunk(done, total)`` after each chunk (progress, or raising to
    abandon the generation there), starting after the longest prefix ``reuse`` holds; :meth:`keep` then
    stores the prompt and its answer there for the next request. ``threads``, asked before each chunk: how many CPU
    threads to read it with (a server gives a prefill that runs alone every core,
    :class:`moaspec.cores.Cores`); the thread's own count is back when the prompt is read. ``share``: the
    other generations of the same prompt this one reads it with (:class:`SharedRead`)."""

    on_chunk: ChunkCallback | None = None
    reuse: PromptCache | None = None
    threads: Callable[[], int] | None = None
    share: SharedRead | None = None

    def __call__(self, model: Transformer, prompt_ids: Sequence[int], cache: KVCache) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Read ``prompt_ids`` into the empty ``cache``: the last position's logits ``[V]``, every prompt position's
        final state ``[T, d]``, and how many leading positions came from ``reuse`` (or ``share``)."""
        if self.share is not None:
            return self.share(prompt_ids, cache, lambda: self._read(model, prompt_ids, cache))
        return self._read(model, prompt_ids, cache)

    def _read(self, model: Transformer, prompt_ids: Sequence[int], cache: KVCache) -> tuple[torch.Tensor, torch.Tensor, int]:
        n, entry = self.reuse.longest(prompt_ids) if self.reuse is not None else (0, None)
        if entry is not None:
            cache.load_prefix(entry.keys, entry.values, n)
        tell, threads = self.on_chunk, self.threads

        def after_chunk(done: int, total: int) -> None:
            if tell is not None:
                tell(n + done, n + total)  # progress counts the reused part as read
            if threads is not None and done < total:
                torch.set_num_threads(threads())  # asked again: other work may have started, or ended

        try:
            with self.reading():
                out = model(torch.tensor([list(prompt_ids[n:])], device=model.device), cache, logits_at=slice(-1, None),
                            on_chunk=after_chunk if tell is not None or threads is not None else None)
        except BaseException:
            cache.length = 0
            raise
        hidden = out.hidden[0] if entry is None else torch.cat([entry.hidden[:n], out.hidden[0]])
        return out.logits[0, -1], hidden, n

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Run the inside on the threads ``threads`` gives (asked once), the thread's own count back after: the
        prompt's read, and the drafter's first pass over it (LSA over a 3,100-token prompt: 1.4 s on one CPU thread)."""
        if self.threads is None:
            yield
            return
        own = torch.get_num_threads()
        torch.set_num_threads(self.threads())
        try:
            yield
        finally:
            torch.set_num_threads(own)

    def known(self, proposer: Resumable, reused: Sequence[int]) -> torch.Tensor | None:
        """What ``proposer`` kept of the ``reused`` tokens (the prompt's reused beginning) when it last read them."""
        if self.reuse is None or not reused or (name := proposer.state_name()) is None:
            return None
        return self.reuse.extra(name, reused)

    def keep(self, tokens: Sequence[int], cache: KVCache, hidden: Sequence[torch.Tensor],
             proposer: Resumable | None = None) -> None:
        """Store ``tokens`` (the prompt, then the verified tokens whose K/V ``cache`` holds; final states
        ``hidden``, in pieces), and what ``proposer`` keeps of them, for later requests, once the generation
        is over: the next turn of a conversation begins with this one's prompt and answer. Stored at the
        end, the copy is not on the way to the first token; decoding never rewrites a verified position."""
        if self.reuse is None:
            return
        extras = {}
        if proposer is not None and (name := proposer.state_name()) is not None and (rows := proposer.kept()) is not None:
            extras[name] = rows
        self.reuse.store(tokens, cache, torch.cat(list(hidden)), extras)
