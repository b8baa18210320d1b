"""Prompt lookup: draft by copying what followed the newest n-gram where it last occurred.

Chat answers repeat their context: a summary quotes its source, code reuses names,
a small model loops. Where the last few verified tokens occurred before, the tokens
that followed them then are a free draft (Saxena's prompt lookup decoding, also in
transformers as ``prompt_lookup_num_tokens``). It costs no model call, so it can run
on its own or in front of a drafter, which then drafts only where lookup finds nothing.

Lookup drafts are deterministic, so for sampling each is a point mass: speculative
sampling accepts it with probability p(x) and otherwise resamples from p without x,
which keeps the target's distribution (see :func:`moaspec.decoding.verify.verify_sampling`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from moaspec.decoding.policy import MAX_NEW, Speculation
from moaspec.decoding.proposer import Proposal, Proposer, Resumable
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.tree import DraftTree, TreeShape
from moaspec.errors import MoaspecError
from moaspec.models.kv_cache import KVCache

# `moaspec generate` and `moaspec serve` put this many lookup drafts before the shipped drafter's
# chains: on SpecBench it took chains of 2 from 1.12x to 1.55x plain decoding
# (docs/experiments/2026-11-22-prompt-lookup.md).
DEFAULT_LOOKUP = 10
# In front of a drafter, a copy must follow at least this many matching tokens: the newest token
# alone recurs almost everywhere, and what followed it last time is a worse guess than the
# drafter's (lookup 10 before chains of 2: 1.11x -> 1.21x and 1.19x -> 1.30x plain decoding, BENCHMARKS.md).
MIN_NGRAM_BEFORE_DRAFTER = 2
# By cost, a first draft after more verified tokens than this read at once is not timed (see Speculation.catching_up)
CATCH_UP = 4


class NgramIndex:
    """Where each n-gram (``min_ngram``..``max_ngram`` tokens) of a growing sequence last occurred.

    Only occurrences with at least one token after them are indexed, so the sequence's
    own newest suffix is never its own match. Updating is incremental: a generation
    indexes each token once, whatever its length.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise MoaspecError(f"lookup n-grams need 1 <= min_ngram <= max_ngram, got {min_ngram}..{max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._last: dict[tuple[int, ...], int] = {}  # n-gram → index of the token that followed it
        self._indexed = 0  # tokens[:_indexed] have had every n-gram ending before them recorded
        self.matched = 0  # how many tokens the last match found covered (0: none)

    def update(self, tokens: Sequence[int]) -> None:
        """Index the n-grams followed by a token of ``tokens`` (which only ever grows)."""
        if len(tokens) < self._indexed:
            raise ValueError("the indexed sequence can only grow")
        for nxt in range(max(self._indexed, 1), len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, nxt) + 1):
                self._last[tuple(tokens[nxt - n : nxt])] = nxt
        self._indexed = max(self._indexed, len(tokens))

    def continuation(self, tokens: Sequence[int], count: int) -> list[int]:
        """Up to ``count`` tokens that followed the longest suffix of ``tokens`` seen before (``[]``: none).

        The copy may run into the suffix itself: then it continues with the tokens it
        has just proposed, so a loop of period p is drafted in full, not p tokens only.
        """
        self.update(tokens)
        return self.match(tokens, count)

    def match(self, tokens: Sequence[int], count: int) -> list[int]:
        """:meth:`continuation` without indexing ``tokens`` first.

        For a sequence whose tail is not settled (drafts still being verified): the
        index holds a prefix of ``tokens`` that will not change, and the tail is only
        looked up, never recorded.
        """
        if len(tokens) < self._indexed:
            raise ValueError("the indexed sequence must be a prefix of the tokens looked up")
        self.matched = 0
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            start = self._last.get(tuple(tokens[len(tokens) - n :]))
            if start is None:
                continue
            self.matched = n
            out: list[int] = []
            for i in range(start, start + count):
                out.append(tokens[i] if i < len(tokens) else out[i - len(tokens)])
            return out
        return []


class LookupProposer:
    """Prompt lookup drafts, with an optional drafter behind it for the cycles where lookup finds nothing.

    Chains: ``drafter_len`` caps the drafter's chain (lookup may propose up to the
    loop's full ``n``): a drafter pays per draft, lookup does not. Trees: the drafter
    grows its tree as usual and up to ``tree_lookup`` lookup drafts are grafted onto it.
    ``min_ngram`` (default: 1 alone, :data:`MIN_NGRAM_BEFORE_DRAFTER` with a drafter) is
    the shortest match that counts.

    With a ``speculation`` (:mod:`moaspec.decoding.policy`) each chain cycle is decided by cost: how many of
    lookup's copied tokens to verify, or whether the drafter drafts (and how far, as it goes), or neither.
    Cycles without the drafter then leave it alone: what they verified reaches it in one piece when it next
    drafts, so a run of lookup or plain steps costs it nothing, and a request it never drafts for never pays
    for its reading of the prompt.
    """

    def __init__(self, vocab_size: int, drafter: Proposer | None = None, drafter_len: int = 0, tree_lookup: int = 0,
                 max_ngram: int = 3, min_ngram: int | None = None, speculation: Speculation | None = None) -> None:
        self.vocab_size = vocab_size  # the target's: sampled proposals carry a distribution over it
        self.drafter = drafter
        self.drafter_len = drafter_len
        self.tree_lookup = tree_lookup
        self.cache: KVCache | None = None
        if min_ngram is None:
            min_ngram = 1 if drafter is None else MIN_NGRAM_BEFORE_DRAFTER
        self.index = NgramIndex(max_ngram, min_ngram)
        self.speculation = speculation
        if speculation is not None and drafter is not None:
            drafter.rule = speculation  # type: ignore[attr-defined]
        self._before = 0  # the target's verified length when the cycle was proposed
        self._proposed = 0
        self._drafted = False  # whether the drafter drafted this cycle
        self._pending: list[torch.Tensor] = []  # hidden states verified since the drafter last heard
        self._pending_verified = 0
        self._begun = True  # whether the drafter has read the prompt (by cost, it waits for its first draft)

    def state_name(self) -> str | None:
        """The drafter's (see :class:`~moaspec.decoding.proposer.Resumable`): lookup's own index is rebuilt cheaply."""
        return self.drafter.state_name() if isinstance(self.drafter, Resumable) else None

    def begin(self, target_cache: KVCache, hidden: torch.Tensor, known: torch.Tensor | None = None) -> None:
        self.cache = target_cache
        self._pending, self._begun = [], True
        if isinstance(self.drafter, Resumable) and known is not None:
            self.drafter.begin(target_cache, hidden, known)
        elif self.drafter is not None and self.speculation is not None:
            self._pending, self._begun = [hidden], False
        elif self.drafter is not None:
            self.drafter.begin(target_cache, hidden)

    def kept(self) -> torch.Tensor | None:
        if not isinstance(self.drafter, Resumable):
            return None
        self._tell_drafter()
        return self.drafter.kept()

    def _copy(self, copied: list[int], sampling: SamplingParams) -> Proposal:
        draft = torch.tensor(copied, dtype=torch.long, device=self.cache.keys.device if self.cache else None)
        if sampling.greedy:
            return Proposal(draft, None)
        return Proposal(draft, torch.nn.functional.one_hot(draft, self.vocab_size).float())

    def propose(self, tokens: Sequence[int], n: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        if self.speculation is not None:
            return self._propose_by_cost(tokens, n, sampling, generator)
        copied = self.index.continuation(tokens, n) if n > 0 else []
        if copied:
            return self._copy(copied, sampling)
        if self.drafter is not None:
            return self.drafter.propose(tokens, min(n, self.drafter_len), sampling, generator)
        return Proposal(torch.zeros(0, dtype=torch.long), None)

    def _propose_by_cost(self, tokens: Sequence[int], n: int, sampling: SamplingParams,
                         generator: torch.Generator | None) -> Proposal:
        assert self.speculation is not None and self.cache is not None, "call begin() first"
        # by cost, lookup's cap is the one trees graft (the loop's ``n`` is the longest chain either may draft)
        copied = self.index.continuation(tokens, min(n, MAX_NEW - 1, self.tree_lookup)) if n and self.tree_lookup else []
        most = min(n, self.drafter_len) if self.drafter is not None else 0
        unread = 0 if self._begun else self.cache.length  # every verified position (the prompt too) until it begins
        kind, count = self.speculation.plan(len(copied), most, self.index.matched, unread)
        self._before, self._drafted = self.cache.length, kind == "drafter"
        if kind == "lookup":
            proposal = self._copy(copied[:count], sampling)
        elif kind == "drafter":
            assert self.drafter is not None
            self._tell_drafter()
            proposal = self.drafter.propose(tokens, most, sampling, generator)
        else:
            proposal = Proposal(torch.zeros(0, dtype=torch.long), None)
        self._proposed = len(proposal.tokens)
        return proposal

    def timed(self, new: int, seconds: float) -> None:
        """The verification of the cycle's proposal (``new`` new tokens) took ``seconds`` (see
        :class:`~moaspec.decoding.proposer.Timed`)."""
        if self.speculation is not None:
            self.speculation.timed(new, seconds)

    def _tell_drafter(self) -> None:
        """Hand the drafter what was verified while it was left alone (the prompt too, if it has not read it yet)."""
        if self.drafter is None or not self._pending:
            return
        if self.speculation is not None and (not self._begun or sum(len(h) for h in self._pending) > CATCH_UP):
            self.speculation.catching_up()
        if not self._begun:
            assert self.cache is not None
            self.drafter.begin(self.cache, torch.cat(self._pending))
            self._begun = True
        else:
            self.drafter.commit(self._pending_verified, None, torch.cat(self._pending))
        self._pending = []

    def propose_tree(self, tokens: Sequence[int], shape: TreeShape) -> DraftTree:
        """The drafter's tree with the lookup drafts grafted below its root, as far as the cache has room."""
        if self.drafter is None or self.cache is None:
            raise ValueError("lookup adds to a drafter's tree: give it a drafter, and call begin() first")
        tree = self.drafter.propose_tree(tokens, shape)  # type: ignore[attr-defined]
        room = self.cache.capacity - self.cache.length - len(tree.parents)
        return tree.graft(self.index.continuation(tokens, min(self.tree_lookup, room)) if room > 0 else [])

    def commit(self, verified: int, path: Sequence[int] | None = None, hidden: torch.Tensor | None = None) -> None:
        if self.speculation is not None and path is None:
            self.speculation.outcome(self._proposed, verified - self._before - 1)
            if not self._drafted and self.drafter is not None and hidden is not None:
                self._pending.append(hidden)  # told when the drafter next drafts (a drafted chain's rollback cannot wait)
                self._pending_verified = verified
                return
        if self.drafter is not None:
            t = time.perf_counter()
            self.drafter.commit(verified, path, hidden)
            if self.speculation is not None:
                self.speculation.read(time.perf_counter() - t)
