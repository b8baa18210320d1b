"""Runs generations for a server: admission, worker threads, streaming, cancellation.

Each request decodes on a worker thread with its own target cache and drafter state
(see :class:`~moaspec.strategy.Strategy`); only the weights are shared. At
most ``parallel`` requests decode at once and at most ``max_queue`` more wait; a
request beyond that is refused at once (:class:`Overloaded`, HTTP 503) rather than
queued without bound. Torch releases the GIL inside its kernels, so parallel requests
do progress together. A request whose client goes away is cancelled at its next
token, or within one chunk of its prompt's prefill (a long prompt's prefill takes
seconds on a CPU: 23 s for 7,900 tokens here); one cancelled while still waiting never
starts, and gives its place in the queue back at once. With a :class:`~moaspec.decoding.prefill.PromptCache`, a request whose prompt
begins with one read recently, and its answer (a conversation's next turn), reads only
the rest.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, replace

from moaspec.batching import BatchedModel, ForwardBatcher
from moaspec.cores import Cores, prefill_threads, working
from moaspec.decoding.generation import GenerationConfig, GenerationResult, TokenLogprob
from moaspec.decoding.prefill import Prefill, PromptCache, SharedRead
from moaspec.errors import MoaspecError
from moaspec.heap import release_free_memory
from moaspec.models.loading import LoadedModel
from moaspec.strategy import Strategy


class Overloaded(MoaspecError):
    """Every decoding slot and queue place is taken."""


class _Cancelled(Exception):
    """Raised inside a worker to abandon a generation whose client has gone."""


@dataclass(frozen=True)
class Piece:
    """A run of generated text, whether it came from accepted drafts, and its tokens' log-probabilities (when asked)."""

    text: str
    drafted: bool
    logprobs: tuple[TokenLogprob, ...] = ()


class Engine:
    """The target, its decoding strategy, and the worker threads that run requests."""

    def __init__(self, target: LoadedModel, strategy: Strategy, parallel: int = 1, max_queue: int = 16,
                 prompt_cache: PromptCache | None = None, cores: Cores | None = None,
                 batcher: ForwardBatcher | None = None) -> None:
        """``cores``: how the CPU's cores are shared between requests (None: each thread keeps what it has);
        ``batcher``: runs the requests' decoding steps and verifications that wait at the same time as one
        forward (None: each request runs its own)."""
        if parallel < 1 or max_queue < 0:
            raise MoaspecError("parallel must be >= 1 and max_queue >= 0")
        self.target = target
        # a BatchedModel stands in for the Transformer: it forwards every attribute, and batches its forwards
        self._runs_on = target if batcher is None else replace(
            target, model=BatchedModel(target.model, batcher))  # type: ignore[arg-type]
        self.strategy = strategy
        self.prompt_cache = prompt_cache  # the prompts recently read, for the next turns of their conversations
        self.cores = cores
        self.parallel = parallel
        self.capacity = parallel + max_queue
        self._pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="moaspec-decode")
        self._lock = threading.Lock()
        self._admitted = 0

    @property
    def context(self) -> int:
        return self.target.cfg.max_position_embeddings

    @property
    def load(self) -> dict[str, int]:
        with self._lock:
            admitted = self._admitted
        return {"running": min(admitted, self.parallel), "waiting": max(0, admitted - self.parallel),
                "capacity": self.capacity}

    def _admit(self, n: int) -> None:
        with self._lock:
            if self._admitted + n > self.capacity:
                raise Overloaded(f"the server is at capacity ({self.parallel} decoding, "
                                 f"{self.capacity - self.parallel} waiting); retry shortly")
            self._admitted += n

    def _release(self) -> None:
        with self._lock:
            self._admitted -= 1

    async def stream(self, prompt_ids: Sequence[int], config: GenerationConfig
                     ) -> AsyncGenerator[Piece | GenerationResult, None]:
        """Yield text pieces as they are verified, then the :class:`GenerationResult`.

        Raises :class:`Overloaded` before anything is yielded when the server is full.
        Closing the iterator early (a client that disconnected) cancels the generation.
        """
        async with aclosing(self.streams([prompt_ids], [config])) as items:
            async for _, item in items:
                yield item

    async def streams(self, prompts: Sequence[Sequence[int]], configs: Sequence[GenerationConfig]
                      ) -> AsyncGenerator[tuple[int, Piece | GenerationResult], None]:
        """Generate one answer per prompt and config (a request's prompts and ``n`` choices), each in its own slot.

        Yields ``(i, item)`` as :meth:`stream` yields items, the choices' pieces interleaved as they come;
        it ends after every choice's result. All choices are admitted together or none is
        (:class:`Overloaded`); closing the iterator early cancels every one still running.
        """
        self._admit(len(configs))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Piece | GenerationResult | BaseException]] = asyncio.Queue()
        cancel = threading.Event()

        def check(*_: object) -> None:
            if cancel.is_set():
                raise _Cancelled

        # choices of one prompt read it once: they start together, so none would find it in the prompt cache
        shares = {key: SharedRead(n) for key, n in Counter(tuple(p) for p in prompts).items() if n > 1}

        def work(i: int, prompt_ids: Sequence[int], config: GenerationConfig) -> None:
            def deliver(item: Piece | GenerationResult | BaseException) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, (i, item))

            told: list[TokenLogprob] = []  # the next piece's entries

            def on_logprobs(entries: Sequence[TokenLogprob]) -> None:
                told.extend(entries)

            def on_piece(text: str, drafted: bool) -> None:
                check()
                deliver(Piece(text, drafted, tuple(told)))
                told.clear()

            try:
                if not cancel.is_set():
                    with working(self.cores):
                        prefill = Prefill(check, self.prompt_cache, prefill_threads(self.cores),
                                          shares.get(tuple(prompt_ids)))
                        deliver(self.strategy.run(self._runs_on, prompt_ids, config, on_piece=on_piece, prefill=prefill,
                                                  on_logprobs=on_logprobs))
            except _Cancelled:
                pass
            except BaseException as exc:  # handed to the request; the worker lives on
                if not cancel.is_set():
                    deliver(exc)
            finally:
                self._release()
                release_free_memory()  # the request's cache and drafter state are freed by now

        jobs: list[Future[None]] = []
        try:
            for i, (prompt_ids, config) in enumerate(zip(prompts, configs, strict=True)):
                jobs.append(self._pool.submit(work, i, prompt_ids, config))
        except BaseException:
            cancel.set()
            for _ in range(len(configs) - len(jobs)):
                self._release()
            raise
        try:
            finished = 0
            while finished < len(configs):
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield i, item
                finished += isinstance(item, GenerationResult)
        finally:
            cancel.set()
            for job in jobs:  # one still queued never runs: its place is given back here, not when a worker gets to it
                if job.cancel():
                    self._release()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
