"""One decoding choice — plain, chain drafting, dynamic trees, prompt lookup — behind one call.

The CLI, the server and the benchmarks all decode through :class:`Strategy`, so a
setting means the same thing everywhere and each request gets its own caches and
drafter state (nothing is shared between generations but the weights). It sits above both
``moaspec.decoding`` (the loops) and ``moaspec.drafters`` (what proposes), which it joins, so that
neither of those imports the other's way up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moaspec.decoding.generation import GenerationConfig, GenerationResult, LogprobCallback, PieceCallback, TextCallback
from moaspec.decoding.lookup import LookupProposer
from moaspec.decoding.policy import MAX_NEW, Policy
from moaspec.decoding.prefill import Prefill
from moaspec.decoding.proposer import check_confidence
from moaspec.decoding.speculative import DEFAULT_CHAIN, generate_chain
from moaspec.decoding.tree import TreeShape, generate_tree
from moaspec.decoding.vanilla import generate
from moaspec.errors import MoaspecError
from moaspec.validation import whole_number

if TYPE_CHECKING:
    from moaspec.drafters.base import Drafter
    from moaspec.models.loading import LoadedModel


@dataclass(frozen=True)
class Strategy:
    """Chains of ``chain`` drafts from ``drafter`` (shorter where its probabilities fall below
    ``confidence``), or its ``tree``; with ``lookup`` > 0, up to that many prompt-lookup drafts
    too (before a chain's drafter, grafted onto a tree). Plain decoding when there is neither
    drafter nor lookup."""

    drafter: Drafter | None = None
    chain: int = DEFAULT_CHAIN
    tree: TreeShape | None = None
    lookup: int = 0
    lookup_min_ngram: int | None = None  # shortest lookup match that counts (None: LookupProposer's rule)
    confidence: float = 0.0  # a chain's drafts after the first need this draft probability (0: off)
    policy: Policy | None = field(default=None, compare=False)  # cost-aware: chains up to ``chain`` and lookup up to ``lookup`` drafts, as they pay

    def __post_init__(self) -> None:
        if not (whole_number(self.chain) and self.chain >= 1):
            raise MoaspecError(f"a chain needs a whole number >= 1 of drafts, got {self.chain!r}")
        if not (whole_number(self.lookup) and self.lookup >= 0):
            raise MoaspecError(f"lookup drafts must be a whole number >= 0 (0 disables lookup), got {self.lookup!r}")
        if self.tree is not None and not isinstance(self.tree, TreeShape):
            raise MoaspecError(f"a tree is a TreeShape(depth, top_k, total), got {self.tree!r}")
        if self.lookup and self.tree is not None and self.drafter is None:
            raise MoaspecError("prompt lookup adds to a drafter's tree; without a drafter it drafts chains")
        if self.policy is not None and self.tree is not None and self.drafter is None:
            raise MoaspecError("a tree needs a drafter")
        check_confidence(self.confidence)
        if self.confidence and self.tree is not None:
            raise MoaspecError("a draft confidence ends chains early; trees are sized by --tree-total instead")
        if self.lookup_min_ngram is not None and self.lookup_min_ngram < 1:
            raise MoaspecError(f"a lookup match needs at least one token, got {self.lookup_min_ngram}")

    def describe(self) -> str:
        min_ngram = f",min_ngram={self.lookup_min_ngram}" if self.lookup_min_ngram is not None else ""
        lookup = f"+lookup({self.lookup}{min_ngram})" if self.lookup else ""
        if self.drafter is None:
            return lookup[1:] or "vanilla"
        kind = type(self.drafter).__name__.removesuffix("Drafter").lower()
        if self.tree is not None:
            by_cost = ",by-cost" if self.policy is not None else ""
            return f"{kind}-tree(depth={self.tree.depth},top_k={self.tree.top_k},total={self.tree.total}{by_cost})" + lookup
        confidence = f",confidence={self.confidence:g}" if self.confidence else ""
        if self.policy is not None:
            return f"by-cost(lookup<={self.lookup},{kind}-chain<={self.chain}{confidence})"
        return f"{kind}-chain({self.chain}{confidence})" + lookup

    def run(self, target: LoadedModel, prompt_ids: Sequence[int], config: GenerationConfig,
            on_text: TextCallback | None = None, on_piece: PieceCallback | None = None,
            prefill: Prefill = Prefill(), on_logprobs: LogprobCallback | None = None) -> GenerationResult:
        """Generate one assistant turn; ``on_piece`` gets (text, came-from-accepted-drafts); ``prefill`` says how
        the prompt is read (told chunk by chunk; reusing recent prompts' K/V); ``on_logprobs`` gets each piece's
        log-probability entries just before it (when ``config.logprobs`` asks for them)."""
        model, tok = target.model, target.tokenizer
        if self.policy is not None and self.tree is None:
            return self._by_cost(target, prompt_ids, config, on_text, on_piece, prefill, on_logprobs)
        speculation = None if self.policy is None else self.policy.request(self.drafter is not None, _draws_seed(config),
                                                                           crowded(model))
        if self.drafter is None and not self.lookup:
            if on_piece is not None:
                piece = on_piece
                on_text = lambda text: piece(text, False)  # noqa: E731
            return generate(model, tok, prompt_ids, config, on_text=on_text, prefill=prefill, on_logprobs=on_logprobs)
        from moaspec.drafters.proposers import proposer_for

        proposer: Any = proposer_for(self.drafter, self.confidence) if self.drafter is not None else None
        if self.lookup:
            proposer = LookupProposer(model.cfg.vocab_size, proposer, drafter_len=self.chain, tree_lookup=self.lookup,
                                      min_ngram=self.lookup_min_ngram)
        if self.tree is not None:
            try:
                return generate_tree(model, tok, proposer, prompt_ids, config, self.tree, on_text=on_text,
                                     on_piece=on_piece, prefill=prefill, on_logprobs=on_logprobs, speculation=speculation)
            finally:
                if speculation is not None:
                    assert self.policy is not None
                    self.policy.finished(speculation)
        return generate_chain(model, tok, proposer, prompt_ids, config, draft_len=max(self.chain, self.lookup),
                              on_text=on_text, on_piece=on_piece, prefill=prefill, on_logprobs=on_logprobs)

    def _by_cost(self, target: LoadedModel, prompt_ids: Sequence[int], config: GenerationConfig,
                 on_text: TextCallback | None, on_piece: PieceCallback | None, prefill: Prefill,
                 on_logprobs: LogprobCallback | None) -> GenerationResult:
        """Chains decided cycle by cycle by :mod:`moaspec.decoding.policy`: lookup, the drafter, or a plain step."""
        from moaspec.drafters.proposers import proposer_for

        assert self.policy is not None
        speculation = self.policy.request(self.drafter is not None, _draws_seed(config), crowded(target.model))
        drafter: Any = proposer_for(self.drafter, self.confidence) if self.drafter is not None else None
        proposer = LookupProposer(target.model.cfg.vocab_size, drafter, drafter_len=self.chain, tree_lookup=self.lookup,
                                  min_ngram=self.lookup_min_ngram, speculation=speculation)
        try:
            return generate_chain(target.model, target.tokenizer, proposer, prompt_ids, config,
                                  draft_len=max(self.chain, min(self.lookup, MAX_NEW - 1)), on_text=on_text,
                                  on_piece=on_piece, prefill=prefill, on_logprobs=on_logprobs)
        finally:
            self.policy.finished(speculation)


def crowded(model: Any) -> Callable[[], bool] | None:
    """What tells a request's policy that the target's forwards run in batches with other requests' (a server's
    :class:`~moaspec.batching.BatchedModel`); None for a target that serves one request at a time."""
    return getattr(model, "crowded", None)


def _draws_seed(config: GenerationConfig) -> int | None:
    """The seed a request's policy must keep reproducible: a sampled request's. A greedy answer is the same
    whatever is drafted, so a seed given with it (a benchmark's, or a client's with temperature 0) must not hold
    the policy to its measured costs and a fresh acceptance, which drafts worse than learning as it goes."""
    return None if config.sampling.greedy else config.sampling.seed
