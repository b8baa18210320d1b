"""Drafters as proposers: chain drafting and EAGLE-2 dynamic trees over a few drafter-specific hooks.

The growing of chains and trees is the same for every drafter; what differs is how a
drafter consumes tokens (:meth:`DrafterProposer._feed`), catches up on verified
tokens, and rolls back after a verification. Fed nodes take consecutive *slots*
after the verified tokens — in the drafter's own cache and, for MoA with Target Layer
Inference, in the target's cache — and a node sees the verified tokens and the slots
of its ancestors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from moaspec.decoding.policy import Speculation
from moaspec.decoding.proposer import Proposal, check_confidence
from moaspec.decoding.sampling import SamplingParams, sample, warp_logits
from moaspec.decoding.tree import DraftTree, TreeShape
from moaspec.drafters.base import Drafter
from moaspec.drafters.eagle import EagleDrafter
from moaspec.drafters.independent import IndependentDrafter
from moaspec.drafters.moa import MoADrafter, MoAState
from moaspec.errors import MoaspecError
from moaspec.models.kv_cache import KVCache


class DrafterProposer:
    """Chain and tree drafting; subclasses implement the hooks below.

    ``confidence`` (0: off) ends a chain early: a draft after the first is proposed only
    while the drafter gives its likeliest token (the greedy draft) at least that probability.
    The shipped drafter's probability is close to the chance that the target accepts the
    draft, so this skips verifying unlikely drafts; it pays only where a verified token costs
    more than the extra drafting step the cut needs (not on this CPU: BENCHMARKS.md). The
    length depends on the drafter alone, never on the target, and is decided before a draft
    is drawn, so verification stays lossless when sampling too.
    """

    drafter: Drafter
    confidence: float = 0.0
    # cost-aware chains (:class:`~moaspec.decoding.policy.Speculation`): asked after each draft whether to keep it,
    # and before each further draft whether to draft it; None drafts the chain asked for
    rule: Speculation | None = None

    def __init__(self) -> None:
        self.cache: KVCache | None = None  # the target's
        self._slots: list[int | None] = []
        # a chain cut short by ``confidence`` has fed its last draft: (the drafter's length then, its output)
        self._fed_last: tuple[int, torch.Tensor, torch.Tensor | None] | None = None

    # --- hooks --------------------------------------------------------------------------

    def _begin(self, hidden: torch.Tensor | None) -> None:
        raise NotImplementedError

    def _own_length(self) -> int:
        """Tokens (or tree slots) the drafter's own cache holds."""
        raise NotImplementedError

    def _feed(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
              parent_features: torch.Tensor | None, outputs: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed ``tokens`` ``[1, T]`` at the next slots; logits ``[outputs, K]`` and features of the last ``outputs``."""
        raise NotImplementedError

    def _catch_up(self, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed every verified token the drafter has not seen, ending with the newest; its logits and feature.

        The default suits drafters whose own cache is indexed by token position alone.
        """
        start = self._own_length()
        feed = torch.tensor([list(tokens[start:])], device=self.device)
        return self._feed(feed, torch.arange(start, len(tokens), device=self.device), None, None, 1)

    def _rollback(self, verified: int, keep_slots: list[int] | None, hidden: torch.Tensor | None) -> None:
        """After a verification: keep the drafter's entries of accepted tokens, learn the new verified state."""
        raise NotImplementedError

    # --- the Proposer interface ---------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return next(self.drafter.parameters()).device

    def begin(self, target_cache: KVCache, hidden: torch.Tensor | None = None, known: torch.Tensor | None = None) -> None:
        """A new sequence (``known``: see :class:`~moaspec.decoding.proposer.Resumable`; given only to a
        proposer whose :meth:`state_name` is not None)."""
        self.cache = target_cache
        if known is None:
            self._begin(hidden)
        else:
            self._resume(hidden, known)

    def _resume(self, hidden: torch.Tensor | None, known: torch.Tensor | None) -> None:
        raise NotImplementedError

    def state_name(self) -> str | None:
        """What this proposer's per-position state is kept under in a prompt cache; None: it keeps none."""
        return None

    def kept(self) -> torch.Tensor | None:
        return None

    def _full_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        d = self.drafter
        if d.draft_vocab is None:
            return probs
        full = probs.new_zeros(probs.shape[:-1] + (d.cfg.vocab_size,))
        return full.index_copy_(-1, d.draft_vocab, probs)

    def propose(self, tokens: Sequence[int], n: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        """A chain of ``n`` drafts, each fed back as the next input."""
        d, cache = self.drafter, self.cache
        assert cache is not None, "call begin() first"
        verified = cache.length
        logits, feat = self._continue(tokens)
        drafts: list[torch.Tensor] = []
        dists: list[torch.Tensor] = []
        rule = self.rule
        for i in range(n):
            if sampling.greedy:
                best = logits[-1].argmax()
                probs = None
            else:
                probs = self._full_vocab(warp_logits(logits[-1], sampling).softmax(-1))
            if (i and self.confidence) or rule is not None:
                # decided before the draw, on the likeliest token as when greedy: a cut that depended on the
                # token drawn would send the kept drafts from another distribution than ``probs``, the one
                # verification divides by, and the output would no longer follow the target's
                p = float(logits[-1].float().softmax(-1)[best]) if probs is None else float(probs.max())
                if (i and p < self.confidence) or (rule is not None and not rule.keep(i, p)):
                    self._fed_last = (self._own_length(), logits, feat)
                    break
            if probs is None:
                tok = d.to_target_ids(best)
            else:
                tok = sample(probs, generator)
                dists.append(probs)
            drafts.append(tok.reshape(1))
            if i + 1 < n and (rule is None or rule.more(i + 1)):
                pos = torch.tensor([verified + 1 + i], device=self.device)
                logits, feat = self._feed(tok.reshape(1, 1), pos, None, feat, 1)
            else:
                break
        return Proposal(torch.cat(drafts) if drafts else torch.zeros(0, dtype=torch.long), torch.stack(dists) if dists else None)

    def propose_tree(self, tokens: Sequence[int], shape: TreeShape) -> DraftTree:
        """Grow an EAGLE-2 dynamic tree from the newest token (see :mod:`moaspec.decoding.tree`)."""
        d, cache = self.drafter, self.cache
        assert cache is not None, "call begin() first"
        device = self.device
        n = cache.length  # verified tokens in the target's cache; the root sits at position n
        logits, feat = self._continue(tokens)
        tok: list[int] = [tokens[-1]]
        parent: list[int] = [-1]
        depth: list[int] = [0]
        score: list[float] = [0.0]
        slot: dict[int, int] = {0: n}
        fed_anc = {0: [n]}  # node → slots of itself and its fed ancestors
        out_feat = {} if feat is None else {0: feat[-1]}  # node → its output features (drafters that make them)
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
            base = self._own_length()
            room = self._room() - base  # near the context's end, grow less
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
            parents_feat = torch.stack([out_feat[parent[i]] for i in expand])[None] if out_feat else None
            logits, feats = self._feed(torch.tensor([[tok[i] for i in expand]], device=device),
                                       torch.tensor([n + level] * k, device=device), mask, parents_feat, k)
            if feats is not None:
                for r, node in enumerate(expand):
                    out_feat[node] = feats[r]
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

    def _room(self) -> int:
        assert self.cache is not None
        return self.cache.capacity

    def _continue(self, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafter's output after ``tokens``: fed what it has not seen yet. A chain cut short fed its last
        draft to decide against the next one, so a client drafting on after it before the verification comes
        back (pipelining) finds nothing new to feed: that output is the one the cut kept."""
        fed, self._fed_last = self._fed_last, None
        if fed is not None and fed[0] == len(tokens) == self._own_length():
            return fed[1], fed[2]
        return self._catch_up(tokens)

    @staticmethod
    def _keep_accepted(own: KVCache, verified: int, keep_slots: list[int] | None) -> None:
        """Trim a token cache to the verified tokens: a chain's prefix, or a tree's accepted path compacted into place."""
        if keep_slots is None:
            own.truncate(min(own.length, verified))
        else:
            own.compact(keep_slots[0], torch.tensor(keep_slots) - keep_slots[0])

    def commit(self, verified: int, path: Sequence[int] | None = None, hidden: torch.Tensor | None = None) -> None:
        """``verified`` tokens are now in the target's cache: a chain's accepted prefix, or a tree's ``path``.

        ``hidden`` holds the target's final hidden states of the newly verified tokens.
        """
        keep = None
        if path is not None:
            # fed nodes form a prefix of the path: a node is only fed if its parent was; nodes grafted
            # onto the tree after it was grown (prompt lookup's) come last and were never fed
            root = self._slots[0]
            assert root is not None, "the root always has a slot"
            fed = (self._slots[i] for i in path if i < len(self._slots))
            keep = [root] + [s for s in fed if s is not None]
        self._fed_last = None
        self._rollback(verified, keep, hidden)


class MoAProposer(DrafterProposer):
    """MoA: SA's cache holds token entries; the memory grows by LSA over newly verified tokens."""

    drafter: MoADrafter

    def __init__(self, drafter: MoADrafter) -> None:
        super().__init__()
        self.drafter = drafter
        self.state: MoAState | None = None
        self._name: str | None = None

    def _begin(self, hidden: torch.Tensor | None) -> None:
        self._resume(hidden, None)

    # What a verified position holds in SA's cache depends on its token alone, and its memory
    # entry on the target's K/V there alone: a conversation's next turn need not redo either
    # (LSA over a 3,100-token prompt and SA catching up on it: 1.9 s on one CPU thread).

    @staticmethod
    def _per_position(state: MoAState) -> tuple[torch.Tensor, ...]:
        """The caches :meth:`kept` and :meth:`_resume` carry, in the order of their rows: memory K, V; SA K, V."""
        return state.memory.keys, state.memory.values, state.sa.keys, state.sa.values

    def state_name(self) -> str:
        if self._name is None:
            self._name = f"moa-drafter:{self.drafter.fingerprint()}"
        return self._name

    def kept(self) -> torch.Tensor:
        """``[n, 4, kv_heads, head_dim]``: CA's key and value of each verified position's memory entry, then
        SA's key and value of its token (n: the positions that have both). In the drafter's weight dtype: caches kept
        in fp32 for a bf16 drafter (``Drafter.cache_dtype``) hold bf16 values, so this is exact at half the bytes."""
        assert self.state is not None
        n = min(self.state.sa.length, self.state.memory.length)
        rows = torch.stack([c[0, 0, :, :n] for c in self._per_position(self.state)]).permute(2, 0, 1, 3)
        return rows.to(self.drafter.weight_dtype)

    def _resume(self, hidden: torch.Tensor | None, known: torch.Tensor | None) -> None:
        """Begin from ``known`` rows (:meth:`kept`'s) for the first positions, or from nothing."""
        assert self.cache is not None
        self.state = state = self.drafter.new_state(self.cache.capacity)
        if known is not None:
            n = known.shape[0]
            rows = known.permute(1, 2, 0, 3).to(state.sa.keys.dtype)  # [4, kv_heads, n, head_dim]
            for c, r in zip(self._per_position(state), rows):
                c[0, 0, :, :n] = r
            state.memory.length = state.sa.length = n
        self.drafter.observe(state, self.cache, self.cache.length, hidden)  # the rest of the prompt

    def _own_length(self) -> int:
        assert self.state is not None
        return self.state.sa.length

    def _room(self) -> int:
        assert self.state is not None and self.cache is not None
        return min(self.state.sa.capacity, self.cache.capacity)

    def _tli_cache(self) -> Any:
        """The cache Target Layer Inference attends over and writes drafted slots into: the target's."""
        return self.cache

    def _catch_up(self, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed SA every token it has not seen; TLI runs on each of them that has no target K/V yet.

        On one device that is the newest token alone. A client that generated while the
        server was unreachable also holds tokens the target never saw: the last N layers
        need the drafter's states for them, as for drafts.
        """
        assert self.state is not None
        start = self.state.sa.length
        outputs = 1
        if self.drafter.cfg.tli_layers:
            outputs = max(1, len(tokens) - max(start, self._tli_cache().length))
        feed = torch.tensor([list(tokens[start:])], device=self.device)
        logits, _ = self._feed(feed, torch.arange(start, len(tokens), device=self.device), None, None, outputs)
        return logits[-1:], None

    def _feed(self, tokens, positions, mask, parent_features, outputs):  # type: ignore[no-untyped-def]
        assert self.state is not None and self.cache is not None
        tli = self._tli_cache()
        verified = tli.length
        tli.length = self.state.sa.length + tokens.shape[1] - outputs  # TLI writes the outputs' slots here
        try:
            logits = self.drafter.step(self.state, tokens, positions, mask, outputs, tli,
                                       tli_mask=None if mask is None else mask[-outputs:])
        finally:
            tli.length = verified  # the target's verified length is unchanged by drafting
        return logits[0], None

    def _rollback(self, verified: int, keep_slots: list[int] | None, hidden: torch.Tensor | None) -> None:
        assert self.state is not None and self.cache is not None
        self._keep_accepted(self.state.sa, verified, keep_slots)
        self.drafter.observe(self.state, self.cache, verified, hidden)


class OwnCacheProposer(DrafterProposer):
    """A drafter with one KV cache of its own, indexed by token position and tree slot (EAGLE, independent)."""

    own: KVCache | None = None

    def _own_length(self) -> int:
        assert self.own is not None
        return self.own.length

    def _room(self) -> int:
        assert self.own is not None
        return self.own.capacity


class EagleProposer(OwnCacheProposer):
    """EAGLE: its cache holds entries made from true features; drafted entries are dropped after verification."""

    drafter: EagleDrafter

    def __init__(self, drafter: EagleDrafter) -> None:
        super().__init__()
        self.drafter = drafter
        self.features: torch.Tensor | None = None  # the target's final hidden state per verified position

    def _begin(self, hidden: torch.Tensor | None) -> None:
        assert self.cache is not None and hidden is not None, "EAGLE needs the target's hidden states"
        self.own = self.drafter.new_cache(self.cache.capacity)
        self.features = torch.zeros(self.cache.capacity, self.drafter.cfg.hidden_size, device=self.device,
                                    dtype=self.drafter.weight_dtype)
        self.features[: hidden.shape[0]] = hidden

    def _feed(self, tokens, positions, mask, parent_features, outputs):  # type: ignore[no-untyped-def]
        assert self.own is not None
        if parent_features.dim() == 2:
            parent_features = parent_features[None]
        logits, feats = self.drafter.step(self.own, tokens, parent_features, positions, mask, outputs)
        return logits[0], feats[0]

    def _catch_up(self, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.own is not None and self.features is not None
        start = self.own.length
        end = len(tokens)
        prev = torch.cat([torch.zeros_like(self.features[:1]), self.features])[start : end]  # f_{j-1} for j in start..end-1
        feed = torch.tensor([list(tokens[start:end])], device=self.device)
        return self._feed(feed, torch.arange(start, end, device=self.device), None, prev[None], 1)

    def _rollback(self, verified: int, keep_slots: list[int] | None, hidden: torch.Tensor | None) -> None:
        assert self.own is not None and self.features is not None and hidden is not None
        root = verified - hidden.shape[0]  # the newly verified tokens start at the root
        self.features[root:verified] = hidden
        self.own.truncate(min(self.own.length, root + 1))  # drafted entries were made from predicted features


class IndependentProposer(OwnCacheProposer):
    """Classic speculative decoding: the drafter's own cache holds every token; drafted entries are rolled back."""

    drafter: IndependentDrafter

    def __init__(self, drafter: IndependentDrafter) -> None:
        super().__init__()
        self.drafter = drafter

    def _begin(self, hidden: torch.Tensor | None) -> None:
        assert self.cache is not None
        self.own = self.drafter.new_cache(self.cache.capacity)

    def _feed(self, tokens, positions, mask, parent_features, outputs):  # type: ignore[no-untyped-def]
        assert self.own is not None
        return self.drafter.step(self.own, tokens, positions, mask, outputs)[0], None

    def _rollback(self, verified: int, keep_slots: list[int] | None, hidden: torch.Tensor | None) -> None:
        assert self.own is not None
        self._keep_accepted(self.own, verified, keep_slots)


P = TypeVar("P", bound="DrafterProposer")
PROPOSERS: dict[type[Drafter], Callable[[Any], DrafterProposer]] = {
    MoADrafter: MoAProposer, EagleDrafter: EagleProposer, IndependentDrafter: IndependentProposer}
"""The proposer that drives each drafter class: a new drafter plugs in by adding its pair."""


def proposer_for(drafter: Drafter, confidence: float = 0.0,
                 kinds: Mapping[type[Drafter], Callable[[Any], P]] = PROPOSERS,  # type: ignore[assignment]
                 where: str = "") -> P:
    """A fresh proposer (one per generation: it holds that generation's drafter state) of the class ``kinds`` names
    for the drafter's type (the client–server ones pass their own, and say so in ``where``).

    ``confidence``: see :class:`DrafterProposer` (0: chains of the full length asked for).
    """
    cls = kinds.get(type(drafter))
    if cls is None:
        raise MoaspecError(f"no {where}proposer for {type(drafter).__name__}")
    proposer = cls(drafter)
    proposer.confidence = check_confidence(confidence)
    return proposer
