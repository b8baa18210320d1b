"""Batched sampling of many independent prompts at once, for making distillation data.

Decoding one sequence leaves a CPU memory-bound; decoding 16–32 rows reads the same
weights once per step for all of them. Prompts are left-padded, each row has its own
positions and a key mask, and rows that finish (EOS or budget) leave the batch so
that the remaining ones do not pay for them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moaspec.decoding.sampling import SamplingParams, select_tokens
from moaspec.models.transformer import Transformer, causal_mask


def generate_batch(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_ids: set[int],
    generator: torch.Generator | None = None,
) -> list[tuple[list[int], bool]]:
    """For each prompt: (new tokens without the stop token, whether a stop token ended it)."""
    B = len(prompts)
    P = max(len(p) for p in prompts)
    dev = model.device
    ids = torch.zeros(B, P, dtype=torch.long, device=dev)
    pos = torch.zeros(B, P, dtype=torch.long, device=dev)
    valid = torch.zeros(B, P + max_new_tokens, dtype=torch.bool, device=dev)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(list(p), device=dev)
        pos[i, P - len(p):] = torch.arange(len(p), device=dev)
        valid[i, P - len(p):P] = True
    mask = causal_mask(0, P, dev)[None] & valid[:, None, :P]
    mask |= torch.eye(P, dtype=torch.bool, device=dev)[None]  # pad queries see themselves: no NaN rows
    cache = model.new_cache(P + max_new_tokens, batch_size=B)
    logits = model(ids, cache, positions=pos, mask=mask, logits_at=slice(-1, None)).logits[:, -1]

    lengths = torch.tensor([len(p) for p in prompts], device=dev)  # next position per row
    alive = torch.arange(B, device=dev)  # original index of each live row
    outputs: list[list[int]] = [[] for _ in range(B)]
    stopped = [False] * B
    for step in range(max_new_tokens):
        nxt = select_tokens(logits, sampling, generator)
        keep = []
        for r, (row, tok) in enumerate(zip(alive.tolist(), nxt.tolist())):
            if tok in stop_ids:
                stopped[row] = True
                continue
            outputs[row].append(tok)
            keep.append(r)
        if not keep or step == max_new_tokens - 1:
            break
        if len(keep) < len(alive):
            k = torch.tensor(keep, device=dev)
            alive, nxt, lengths, valid = alive[k], nxt[k], lengths[k], valid[k]
            cache.select_rows(k)
        S = P + step + 1
        valid[:, S - 1] = True
        logits = model(nxt[:, None], cache, positions=lengths[:, None], mask=valid[:, None, :S]).logits[:, -1]
        lengths = lengths + 1
    return [(outputs[i], stopped[i]) for i in range(B)]
