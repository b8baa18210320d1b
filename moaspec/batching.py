"""Many requests' forwards in one target forward, once they outnumber the cores.

A decoding step on a CPU costs reading the weights, whatever the number of tokens (up to a
few dozen), so a server with many clients spends most of its time reading the same weights
for each of them in turn: 8 verifications of 3 tokens took 99 ms as one forward
(:meth:`~moaspec.models.transformer.Transformer.forward_many`) against 292 ms one after
another (SmolLM2, 2 threads; docs/experiments/2026-11-29-batched-forwards.md). But two
forwards on two cores, each on its own, finish sooner than both as one forward on one thread.
So a :class:`ForwardBatcher` has ``lanes`` (the forwards the cores can run side by side): a
forward runs at once on its caller's thread while a lane is free and nothing waits; past that
it queues, and one batching thread runs everything queued as one forward as soon as a lane
frees; while batches hold several forwards, every forward queues for them. No forward waits
for others to come, so a lone client is not slowed. Client–server
verifications use it directly (:class:`~moaspec.clientserver.sessions.SessionStore`); the
OpenAI routes' decoders see the target through :class:`BatchedModel`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from moaspec.cores import Cores, working
from moaspec.models.kv_cache import KVCache
from moaspec.models.transformer import Call, ChunkCallback, ForwardOutput, Transformer

BATCHED_TOKENS = 64  # the most new tokens of a forward that joins a batch: verifications, not prompts


@dataclass
class _Job:
    call: Call
    done: threading.Event = field(default_factory=threading.Event)
    out: ForwardOutput | None = None
    error: BaseException | None = None


class ForwardBatcher:
    """Runs the forwards that threads ask for (:meth:`forward`): each alone while the cores have room, those that
    queue past that together as one."""

    def __init__(self, model: Transformer, cores: Cores | None = None, lanes: int = 1) -> None:
        """``cores``: how the server shares its CPU (a batch runs on every core while nothing else runs);
        ``lanes``: how many forwards may run at once, each on its own thread (the cores over each one's share)."""
        self.model, self.cores, self.lanes = model, cores, max(1, lanes)
        self.forwards = self.runs = 0  # forwards asked for, and forwards run (alone or batched): how well they batched
        self._queue: list[_Job] = []
        self._running = 0  # forwards running now: alone on their callers' threads, or the batch
        self._waiting = 0  # callers whose forwards are queued or in the batch: busy on the cores, but only waiting
        # the last batch held several forwards: more are asked for than lanes serve, so none runs alone until that
        # ends (one alone beside the batch splits the cores: 8 streaming clients, 50 tokens/s against 62)
        self._crowded = False
        self._wake = threading.Condition()
        threading.Thread(target=self._serve, name="moaspec-batcher", daemon=True).start()

    def forward(self, call: Call) -> ForwardOutput:
        """What ``model(call.tokens, call.cache, ...)`` returns: computed now if a lane is free, else in the next batch.

        A call that cannot run (its cache is full) is refused here, alone, before it could fail a batch.
        """
        call.cache.check_room(call.tokens.shape[1])
        with self._wake:
            self.forwards += 1
            alone = self._running < self.lanes and not self._queue and not self._crowded
            if alone:
                self._running += 1
                self.runs += 1
            else:
                job = _Job(call)
                self._queue.append(job)
                self._waiting += 1
                self._wake.notify_all()
        if alone:
            try:
                return self.model(call.tokens, call.cache, call.positions, call.mask, call.logits_at)
            finally:
                self._free()
        job.done.wait()
        with self._wake:
            self._waiting -= 1
        if job.error is not None:
            raise job.error
        assert job.out is not None
        return job.out

    def crowded(self) -> bool:
        """Whether forwards are being run together now: more are asked for than the lanes run side by side."""
        with self._wake:
            return self._crowded or bool(self._queue)

    def _free(self) -> None:
        with self._wake:
            self._running -= 1
            self._wake.notify_all()

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._queue or self._running >= self.lanes:
                    self._wake.wait()
                jobs, self._queue = self._queue, []
                self._crowded = len(jobs) > 1
                self._running += 1
                self.runs += 1
                waiting = self._waiting
            try:
                with working(self.cores):
                    if self.cores is not None:  # every core, unless other work runs
                        torch.set_num_threads(self.cores.for_prefill(waiting))
                    outs = self.model.forward_many([j.call for j in jobs])
                for job, out in zip(jobs, outs):
                    job.out = out
            except BaseException as exc:  # handed to every caller of the batch; the thread serves on
                for job in jobs:
                    job.error = exc
            finally:
                self._free()
            for job in jobs:
                job.done.set()


class BatchedModel:
    """The target as a server's decoders see it: their decoding steps and verifications go through ``batcher``,
    with whatever other requests' forwards wait at the time; anything else (a prompt read in chunks, states
    after a given layer) runs as asked. Every other attribute is the model's."""

    def __init__(self, model: Transformer, batcher: ForwardBatcher) -> None:
        self.model, self.batcher = model, batcher

    def __getattr__(self, name: str) -> object:
        return getattr(self.model, name)

    def crowded(self) -> bool:
        """Whether this request's forwards now run together with other requests' (:meth:`ForwardBatcher.crowded`):
        each token of a batch then costs what a plain step's does, so the decoding policy takes plain steps."""
        return self.batcher.crowded()

    def __call__(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, logits_at: slice | torch.Tensor | None = None,
                 hidden_after: tuple[int, ...] = (), on_chunk: ChunkCallback | None = None) -> ForwardOutput:
        if tokens.shape[0] != 1 or tokens.shape[1] > BATCHED_TOKENS or hidden_after or on_chunk is not None:
            return self.model(tokens, cache, positions, mask, logits_at, hidden_after, on_chunk)
        return self.batcher.forward(Call(tokens, cache, positions, mask, logits_at))
