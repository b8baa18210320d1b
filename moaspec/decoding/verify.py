"""Verification of drafts against the target: pure functions, tested alone (as vLLM keeps its rejection sampler).

Each takes the drafted tokens and the target's scores for every drafted position
plus one, and returns how many drafts are accepted and the token the target adds
after them (the correction, or the bonus token when all drafts pass). No state, no
model: the decoding loop owns caches and bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moaspec.decoding.sampling import sample


@dataclass(frozen=True)
class Verdict:
    accepted: int  # leading drafts the target keeps
    next_token: int  # the target's own token after them


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Keep drafts while each equals the target's argmax; ``target_logits`` is ``[T+1, V]`` for ``T`` drafts.

    Row ``i`` scores the position of draft ``i`` (the target's view after the tokens
    before it); row ``T`` gives the bonus token when every draft is accepted.
    """
    best = target_logits.argmax(dim=-1)
    T = draft.shape[0]
    miss = (best[:T] != draft).nonzero()
    k = int(miss[0]) if miss.numel() else T
    return Verdict(k, int(best[k]))


def verify_sampling(draft: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                    generator: torch.Generator | None) -> Verdict:
    """Speculative sampling for a chain (Leviathan et al. 2023; Chen et al. 2023).

    Draft ``i`` (drawn from ``draft_probs[i]``) is accepted with probability
    ``min(1, p(x)/q(x))``; at the first rejection the token is drawn from the
    normalised residual ``max(0, p − q)``; if all pass, the bonus token is drawn from
    ``target_probs[T]``. The output then follows the target's distribution exactly,
    whatever the drafter proposes. ``draft_probs`` ``[T, V]``, ``target_probs`` ``[T+1, V]``.
    """
    T = draft.shape[0]
    if T == 0:  # nothing drafted (near the context's end, or lookup found nothing): a plain step
        return Verdict(0, int(sample(target_probs[0], generator)))
    if draft_probs is None:
        raise ValueError("sampled drafts need the distributions they were drawn from")
    idx = torch.arange(T, device=draft.device)
    p = target_probs[idx, draft]
    q = draft_probs[idx, draft]
    u = torch.rand(T, generator=generator, device=draft.device)
    ok = (q > 0) & (u * q <= p)  # u < p/q without dividing by zero
    miss = (~ok).nonzero()
    k = int(miss[0]) if miss.numel() else T
    if k == T:
        return Verdict(T, int(sample(target_probs[T], generator)))
    residual = (target_probs[k] - draft_probs[k]).clamp_min(0)
    total = residual.sum()
    dist = residual / total if total > 0 else target_probs[k]
    return Verdict(k, int(sample(dist, generator)))


def verify_tree(tokens: torch.Tensor, parents: list[int], target_probs: torch.Tensor, greedy: bool,
                generator: torch.Generator | None) -> tuple[list[int], int]:
    """Walk a draft tree from its root (node 0), accepting at most one child per node.

    ``tokens[i]`` is node ``i``'s token, ``parents[i]`` its parent (``-1`` for the
    root); row ``i`` of ``target_probs`` (``[N, V]``; logits when ``greedy``) is the
    target's distribution after node ``i``. Returns the accepted nodes (root
    excluded, in order) and the target's token after the last of them.

    Greedy: follow the child whose token is the target's argmax. Sampling: the
    children were chosen deterministically (top-k), so each is a draft whose
    distribution is a point mass, and multi-draft recursive rejection sampling becomes:
    accept child ``c`` with probability ``r(c) / Σ r`` where ``r`` is the residual
    (the target's distribution with the already-rejected children removed); if every
    child is rejected, draw from the residual. Each step then draws exactly from the
    target's distribution, so the output does too.
    """
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            children.setdefault(p, []).append(i)
    path: list[int] = []
    node = 0
    while True:
        kids = children.get(node, [])
        if greedy:
            best = int(target_probs[node].argmax())
            nxt = next((c for c in kids if int(tokens[c]) == best), None)
            if nxt is None:
                return path, best
        else:
            residual = target_probs[node].clone()
            nxt = None
            for c in kids:
                tok = int(tokens[c])
                total = residual.sum()
                if total > 0 and float(torch.rand((), generator=generator)) * float(total) < float(residual[tok]):
                    nxt = c
                    break
                residual[tok] = 0.0
            if nxt is None:
                total = residual.sum()
                dist = residual / total if total > 0 else target_probs[node]
                return path, int(sample(dist, generator))
        path.append(nxt)
        node = nxt
