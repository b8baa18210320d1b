"""The MoA drafter as a :class:`~moaspec.decoding.proposer.Proposer` for chain drafting."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moaspec.decoding.proposer import Proposal
from moaspec.decoding.sampling import SamplingParams, sample, warp_logits
from moaspec.drafters.moa import MoADrafter, MoAState
from moaspec.models.kv_cache import KVCache


class MoAProposer:
    """Drafts a chain: feed the newest verified tokens to SA, then one drafted token per step.

    Only the Cross-Attention query changes while drafting; the memory grows once per
    cycle in :meth:`commit`, with LSA run on the newly verified tokens only.
    """

    def __init__(self, drafter: MoADrafter) -> None:
        self.drafter = drafter
        self.state: MoAState | None = None
        self.cache: KVCache | None = None

    def begin(self, target_cache: KVCache, capacity: int) -> None:
        self.cache = target_cache
        self.state = self.drafter.new_state(capacity)
        self.drafter.observe(self.state, target_cache, target_cache.length)

    def _full_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        d = self.drafter
        if d.draft_vocab is None:
            return probs
        full = probs.new_zeros(probs.shape[:-1] + (d.cfg.vocab_size,))
        return full.index_copy_(-1, d.draft_vocab, probs)

    def propose(self, tokens: Sequence[int], n: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        d, state, cache = self.drafter, self.state, self.cache
        assert state is not None and cache is not None, "call begin() first"
        device = d.lsa_proj.weight.device
        verified = cache.length
        pos = state.sa.length
        feed = torch.tensor([list(tokens[pos:])], device=device)
        drafts: list[torch.Tensor] = []
        dists: list[torch.Tensor] = []
        for _ in range(n):
            T = feed.shape[1]
            cache.length = pos + T - 1  # TLI writes the drafted position's states here (overwritten by verification)
            logits = d.step(state, feed, torch.arange(pos, pos + T, device=device), None, outputs=1,
                            target_cache=cache)[0, -1]
            if sampling.greedy:
                tok = d.to_target_ids(logits.argmax())
            else:
                probs = self._full_vocab(warp_logits(logits, sampling).softmax(-1))
                tok = sample(probs, generator)
                dists.append(probs)
            drafts.append(tok.reshape(1))
            pos += T
            feed = tok.reshape(1, 1)
        cache.length = verified
        return Proposal(torch.cat(drafts), torch.stack(dists) if dists else None)

    def commit(self, verified: int) -> None:
        assert self.state is not None and self.cache is not None
        self.state.sa.truncate(min(self.state.sa.length, verified))
        self.drafter.observe(self.state, self.cache, verified)
