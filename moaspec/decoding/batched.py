"""Batched generation of many independent requests at once, for making distillation data.

Decoding one sequence leaves a CPU memory-bound; decoding 32–64 rows reads the same
weights once per step for all of them. Two things keep the batch full:

* **Prefill without padding.** Each request's context is prefilled on its own, straight
  into its row of the shared cache (right-aligned), so a short prompt never pays for
  the longest one's length.
* **Refill by recompute** (vLLM's recompute preemption, at batch granularity). Rows
  that finish (stop token or budget) leave the batch. When fewer than ``refill_below``
  of the rows are still alive and requests are waiting, the survivors are paused, their
  tokens so far kept, and a new batch is formed from the waiting requests and the
  paused ones. A paused row costs one prefill of its context later, far less than
  decoding a thin batch for hundreds of steps at nearly the price of a full one.

Every row has its own positions, key mask, budget and sampling rule, so greedy and
sampled requests share batches. Sampling draws from one generator in a fixed order,
so a run is reproducible for the same requests and settings.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moaspec.decoding.sampling import SamplingParams, select_tokens
from moaspec.models.transformer import Transformer


@dataclass(frozen=True)
class Request:
    """One sequence to continue: its context, how many tokens at most, and how to pick them."""

    prompt: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()

    def __post_init__(self) -> None:
        if self.sampling.adjusted:
            raise ValueError("batched generation does not apply penalties or a logit bias")


def generate_many(
    model: Transformer,
    requests: Sequence[Request],
    stop_ids: set[int],
    generator: torch.Generator | None = None,
    batch_size: int = 32,
    refill_below: float = 0.5,
) -> list[tuple[list[int], bool]]:
    """For each request: (new tokens without the stop token, whether a stop token ended it).

    ``refill_below`` is the fraction of live rows under which a batch is paused and
    refilled while requests wait (0 runs every batch to its end).
    """
    if any(len(r.prompt) == 0 for r in requests):
        raise ValueError("every request needs a non-empty prompt")
    outputs: list[list[int]] = [[] for _ in requests]
    stopped = [False] * len(requests)
    waiting = deque(i for i, r in enumerate(requests) if r.max_new_tokens > 0)
    while waiting:
        rows = [waiting.popleft() for _ in range(min(batch_size, len(waiting)))]
        min_alive = int(len(rows) * refill_below) if waiting else 0
        contexts = [list(requests[i].prompt) + outputs[i] for i in rows]
        budgets = [requests[i].max_new_tokens - len(outputs[i]) for i in rows]
        results = _decode(model, contexts, budgets, [requests[i].sampling for i in rows], stop_ids, generator, min_alive)
        for i, (tokens, status) in zip(rows, results):
            outputs[i] += tokens
            if status == "paused":
                waiting.append(i)
            stopped[i] = status == "stop"
    return [(outputs[i], stopped[i]) for i in range(len(requests))]


def _decode(
    model: Transformer,
    contexts: list[list[int]],
    budgets: list[int],
    sampling: list[SamplingParams],
    stop_ids: set[int],
    generator: torch.Generator | None,
    min_alive: int,
) -> list[tuple[list[int], str]]:
    """Decode one batch; each row ends as "stop", "budget" or (when too few are left) "paused"."""
    B, dev = len(contexts), model.device
    P = max(len(c) for c in contexts)
    cache = model.new_cache(P + max(budgets), batch_size=B)
    valid = torch.zeros(B, cache.capacity, dtype=torch.bool, device=dev)
    last = []
    for b, ctx in enumerate(contexts):  # right-aligned at column P, without padding compute
        row = cache.row_view(b, P - len(ctx))
        ids = torch.tensor(ctx, device=dev)[None]
        last.append(model(ids, row, logits_at=slice(-1, None)).logits[0, -1])
        valid[b, P - len(ctx) : P] = True
    cache.length = P
    logits = torch.stack(last)

    rules = list(dict.fromkeys(sampling))  # the distinct sampling rules, in first-seen order
    positions = torch.tensor([len(c) for c in contexts], device=dev)  # next position per row
    alive = list(range(B))  # original row of each live batch row
    outputs: list[list[int]] = [[] for _ in range(B)]
    status = ["paused"] * B
    while True:
        nxt = torch.empty(len(alive), dtype=torch.long, device=dev)
        for params in rules:
            sel = [r for r, row in enumerate(alive) if sampling[row] == params]
            if sel:
                idx = torch.tensor(sel, device=dev)
                nxt[idx] = select_tokens(logits[idx], params, generator)
        keep = []
        for r, (b, tok) in enumerate(zip(alive, nxt.tolist())):  # b: the row's place in the whole batch
            if tok in stop_ids:
                status[b] = "stop"
                continue
            outputs[b].append(tok)
            if len(outputs[b]) == budgets[b]:
                status[b] = "budget"
                continue
            keep.append(r)
        if len(keep) < len(alive):
            if not keep or len(keep) < min_alive:
                break
            k = torch.tensor(keep, device=dev)
            alive, nxt, positions, valid = [alive[r] for r in keep], nxt[k], positions[k], valid[k]
            cache.select_rows(k)
        S = cache.length
        valid[:, S] = True
        logits = model(nxt[:, None], cache, positions=positions[:, None], mask=valid[:, None, : S + 1]).logits[:, -1]
        positions = positions + 1
    return [(outputs[b], status[b]) for b in range(B)]
