"""The MoA drafter as a :class:`~moaspec.decoding.proposer.Proposer` for chain drafting."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moaspec.decoding.proposer import Proposal
from moaspec.decoding.tree import DraftTree, TreeShape
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

    def begin(self, target_cache: KVCache) -> None:
        self.cache = target_cache
        self.state = self.drafter.new_state(target_cache.capacity)
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

    def propose_tree(self, tokens: Sequence[int], shape: TreeShape) -> DraftTree:
        """Grow an EAGLE-2 dynamic tree from the newest token (see :mod:`moaspec.decoding.tree`).

        Fed nodes take consecutive "slots" after the verified tokens, in SA's cache and,
        with TLI, in the target's cache; a node sees the verified tokens and the slots of
        its ancestors. Only expanded nodes are fed; leaves cost nothing until verified.
        """
        d, state, cache = self.drafter, self.state, self.cache
        assert state is not None and cache is not None, "call begin() first"
        device = d.lsa_proj.weight.device
        n = cache.length  # verified tokens in the target's cache; the root sits at position n
        start = state.sa.length
        feed = torch.tensor([list(tokens[start:])], device=device)
        logits = d.step(state, feed, torch.arange(start, n + 1, device=device), None, outputs=1, target_cache=cache)[0]
        tok: list[int] = [tokens[-1]]
        parent: list[int] = [-1]
        depth: list[int] = [0]
        score: list[float] = [0.0]
        slot: dict[int, int] = {0: n}  # node → slot (position of its SA / TLI entries)
        fed_anc = {0: [n]}  # node → slots of itself and its fed ancestors
        expand = [0]
        for level in range(1, shape.depth + 1):
            logp = torch.log_softmax(logits.float(), dim=-1)
            top = logp.topk(min(shape.top_k, logp.shape[-1]), dim=-1)
            ids = d.to_target_ids(top.indices).tolist()
            level_nodes = []
            for row, node in enumerate(expand):
                for j in range(top.indices.shape[1]):
                    tok.append(ids[row][j])
                    parent.append(node)
                    depth.append(level)
                    score.append(score[node] + float(top.values[row, j]))
                    level_nodes.append(len(tok) - 1)
            if level == shape.depth:
                break
            base = state.sa.length
            room = min(state.sa.capacity, cache.capacity) - base  # near the context's end, grow less
            expand = sorted(level_nodes, key=lambda i: -score[i])[: min(shape.top_k, room)]
            k = len(expand)
            if not k:
                break
            mask = torch.zeros(k, base + k, dtype=torch.bool, device=device)
            mask[:, :n] = True
            for r, node in enumerate(expand):
                slot[node] = base + r
                fed_anc[node] = fed_anc[parent[node]] + [base + r]
                mask[r, fed_anc[node]] = True
            cache.length = base  # TLI writes the new nodes' states at slots base..base+k-1
            logits = d.step(state, torch.tensor([[tok[i] for i in expand]], device=device),
                            torch.tensor([n + level] * k, device=device), mask, outputs=k, target_cache=cache,
                            tli_mask=mask)[0]
        cache.length = n
        # keep the best nodes; a child never outscores its parent, but guard ties by adding ancestors
        ranked = sorted(range(1, len(tok)), key=lambda i: -score[i])[: shape.total - 1]
        keep = set(ranked)
        for i in ranked:
            p = parent[i]
            while p > 0 and p not in keep:
                keep.add(p)
                p = parent[p]
        order = [0] + sorted(keep, key=lambda i: (depth[i], -score[i]))[: shape.total - 1]
        index = {node: i for i, node in enumerate(order)}
        self._slots = [slot.get(node) for node in order]
        return DraftTree(
            tokens=torch.tensor([tok[i] for i in order], dtype=torch.long),
            parents=[index[parent[i]] if i else -1 for i in order],
            depths=torch.tensor([depth[i] for i in order], dtype=torch.long),
        )

    def commit(self, verified: int, path: Sequence[int] | None = None) -> None:
        """Keep SA entries of the verified tokens (a chain prefix, or a tree's accepted path) and grow the memory."""
        assert self.state is not None and self.cache is not None
        sa = self.state.sa
        if path is None:
            sa.truncate(min(sa.length, verified))
        else:
            root = self._slots[0]
            keep = [root] + [s for s in (self._slots[i] for i in path) if s is not None]
            # fed nodes form a prefix of the path: a node is only fed if its parent was
            sa.compact(root, torch.tensor(keep) - root)
        self.drafter.observe(self.state, self.cache, verified)
