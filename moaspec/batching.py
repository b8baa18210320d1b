"""Many requests' forwards in one target forward: a server's threads hand their small forwards to one batching thread.

A decoding step on a CPU costs reading the weights, whatever the number of tokens (up to a
few dozen), so a server with many clients spends most of its time reading the same weights
for each of them in turn. Here every verification hands its forward (a few tokens) to one
thread that runs all the forwards waiting at that moment as one
(:meth:`~moaspec.models.transformer.Transformer.forward_many`): 8 verifications of 3 tokens
took 99 ms together against 292 ms one after another (SmolLM2, 2 threads; BENCHMARKS.md,
"Verifying many sessions at once"). No request waits for others to come: a batch takes what
is queued when the last one ends (what queued up while it ran), so a lone client is not slowed,
and under load the batches fill by themselves. Client–server verifications use it directly
(:class:`~moaspec.clientserver.sessions.SessionStore`); the OpenAI routes' decoders see the
target through :class:`BatchedModel`, so concurrent requests' decoding steps and
verifications run together.
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
    """Runs the forwards that threads ask for (:meth:`forward`) on one thread of its own, those waiting together as one."""

    def __init__(self, model: Transformer, cores: Cores | None = None) -> None:
        """``cores``: how the server shares its CPU; a batch runs on every core while nothing else runs."""
        self.model, self.cores = model, cores
        self.batches = self.forwards = 0  # for tests and logs: how well the forwards were batched
        self._queue: list[_Job] = []
        self._waiting = 0  # callers inside forward(): they count busy on the cores, but only wait for this thread
        self._wake = threading.Condition()
        threading.Thread(target=self._serve, name="moaspec-batcher", daemon=True).start()

    def forward(self, call: Call) -> ForwardOutput:
        """What ``model(call.tokens, call.cache, ...)`` returns, computed with whatever other forwards are waiting.

        A call that cannot run (its cache is full) is refused here, alone, before it could fail a batch.
        """
        T, cache = call.tokens.shape[1], call.cache
        if cache.length + T > cache.capacity:
            raise ValueError(f"cache overflow: {cache.length} cached + {T} new > capacity {cache.capacity}")
        job = _Job(call)
        with self._wake:
            self._queue.append(job)
            self._waiting += 1
            self._wake.notify()
        job.done.wait()
        with self._wake:
            self._waiting -= 1
        if job.error is not None:
            raise job.error
        assert job.out is not None
        return job.out

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._queue:
                    self._wake.wait()
                jobs, self._queue = self._queue, []
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
            self.batches, self.forwards = self.batches + 1, self.forwards + len(jobs)
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

    def __call__(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, logits_at: slice | torch.Tensor | None = None,
                 hidden_after: tuple[int, ...] = (), on_chunk: ChunkCallback | None = None) -> ForwardOutput:
        if tokens.shape[0] != 1 or tokens.shape[1] > BATCHED_TOKENS or hidden_after or on_chunk is not None:
            return self.model(tokens, cache, positions, mask, logits_at, hidden_after, on_chunk)
        return self.batcher.forward(Call(tokens, cache, positions, mask, logits_at))
