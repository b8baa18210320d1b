"""Speculative decoding with a chain of drafts (the paper's Algorithm 1), greedy or sampled.

    prefill the prompt → the target's first token
    repeat: the proposer drafts T tokens → one target forward scores the newest token
            and the T drafts → keep the accepted prefix and the target's own next token →
            roll the target's cache back to the kept tokens → tell the proposer

Greedy output equals the target's greedy output token for token; with sampling the
output follows the target's distribution (see :mod:`moaspec.decoding.verify`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from moaspec.decoding.generation import (
    GenerationConfig,
    GenerationResult,
    LogprobCallback,
    PieceCallback,
    TextCallback,
    TokenLogprob,
    TokenSink,
)
from moaspec.decoding.opening import open_generation
from moaspec.decoding.prefill import Prefill
from moaspec.decoding.proposer import Proposer, Resumable, Timed
from moaspec.decoding.sampling import (
    SamplingParams,
    adjust,
    adjust_rows,
    count_tokens,
    probabilities,
    select_token,
)
from moaspec.decoding.verify import verify_greedy, verify_sampling
from moaspec.models.kv_cache import KVCache
from moaspec.models.transformer import Transformer

# Tuned on this CPU with the shipped drafter (benchmarks/sweep.py, BENCHMARKS.md): with its
# acceptance, longer chains cost more drafting than they save.
DEFAULT_CHAIN = 2
# The drafter's probability a chain's later drafts need (0: every chain is DEFAULT_CHAIN long).
DEFAULT_CONFIDENCE = 0.0


@dataclass
class Run:
    """One speculative generation's state after the prefill, shared by the chain and tree loops."""

    model: Transformer
    cache: KVCache
    sink: TokenSink
    params: SamplingParams
    generator: torch.Generator
    tokens: list[int]  # prompt, then every verified token (the newest has no K/V in the cache yet)
    prompt_tokens: int
    budget: int
    t0: float
    prefill_s: float
    prefill: Prefill
    hidden: list[torch.Tensor]  # final states of the cached positions, in pieces, with a prompt cache only (see verified)
    reused_prompt_tokens: int = 0
    resumable: Resumable | None = None  # the proposer, when its state is kept with the prompt cache
    accepted: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    counts: torch.Tensor | None = None  # how often each token occurs in the answer, with penalties only
    scored: list[TokenLogprob | None] | None = None  # the prompt's tokens' log-probabilities, when asked

    def adjusted(self, logits: torch.Tensor, nodes: torch.Tensor, ancestors: torch.Tensor | None = None) -> torch.Tensor:
        """A verification's logits with the logit bias and the penalties (:func:`~moaspec.decoding.sampling.adjust_rows`)."""
        return adjust_rows(logits, self.params, self.counts, nodes, ancestors)

    def next_token(self, logits: torch.Tensor) -> int:
        """A plain step's token from its logits ``[1, V]``: adjusted by the answer so far and picked as vanilla
        decoding picks it (a cycle the policy leaves undrafted costs what a step of vanilla decoding does)."""
        return select_token(adjust(logits[-1], self.params, self.counts), self.params, self.generator)

    def count(self, new: Sequence[int]) -> None:
        """Add newly verified tokens to the answer's counts (with penalties)."""
        count_tokens(self.counts, new)

    def verified(self, hidden: torch.Tensor) -> None:
        """Keep the final states of newly verified positions, for a prompt cache to store at the end (none: not kept)."""
        if self.prefill.reuse is not None:
            self.hidden.append(hidden)

    @contextmanager
    def drafting(self) -> Iterator[None]:
        """Count the time inside as the drafter's: proposing, and taking in what was verified (MoA's LSA)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.draft_s += time.perf_counter() - t

    def result(self) -> GenerationResult:
        text = self.sink.close()
        self.prefill.keep(self.tokens[: self.cache.length], self.cache, self.hidden, self.resumable)
        return GenerationResult(
            token_ids=self.sink.tokens, text=text, finish_reason=self.sink.finish_reason, prompt_tokens=self.prompt_tokens,
            prefill_s=self.prefill_s, total_s=time.perf_counter() - self.t0, target_calls=len(self.accepted),
            accepted_lengths=self.accepted, draft_s=self.draft_s, reused_prompt_tokens=self.reused_prompt_tokens,
            logprobs=self.sink.logprobs, prompt_logprobs=self.scored,
        )


def start(model: Transformer, tokenizer: Any, proposer: Proposer | Any, prompt_ids: Sequence[int],
          config: GenerationConfig, room: int, on_text: TextCallback | None, on_piece: PieceCallback | None,
          prefill: Prefill = Prefill(), on_logprobs: LogprobCallback | None = None, begin: bool = True) -> Run:
    """Open the generation (:func:`~moaspec.decoding.opening.open_generation`), pick the first token, and start
    the proposer (not where ``begin`` is False and no prompt cache keeps its state: the caller begins it when it
    first drafts, with the prompt's states, ``run.hidden[0]``).

    ``room`` is how many positions past the budget a verification may write.
    """
    o = open_generation(model, tokenizer, prompt_ids, config, prefill, room, on_text, on_piece, on_logprobs)
    tokens = list(prompt_ids) + [select_token(adjust(o.logits, config.sampling), config.sampling, o.generator)]
    resumable = proposer if prefill.reuse is not None and isinstance(proposer, Resumable) else None
    run = Run(model, o.cache, o.sink, config.sampling, o.generator, tokens, len(prompt_ids), o.budget, o.t0,
              o.prefill_s, prefill, [o.hidden], o.reused, resumable, counts=o.counts, scored=o.scored)
    run.count(tokens[-1:])
    if not o.sink.push(tokens[-1:], scores=o.logits[None]) and (begin or resumable is not None):
        with prefill.reading():
            if resumable is not None:
                resumable.begin(o.cache, o.hidden, prefill.known(resumable, prompt_ids[:o.reused]))
            else:
                proposer.begin(o.cache, o.hidden)
    else:
        run.resumable = None  # done at the first token (e.g. a prompt scored alone): the proposer never began
    return run


def generate_chain(
    model: Transformer,
    tokenizer: Any,
    proposer: Proposer,
    prompt_ids: Sequence[int],
    config: GenerationConfig = GenerationConfig(),
    draft_len: int = DEFAULT_CHAIN,
    on_text: TextCallback | None = None,
    on_piece: PieceCallback | None = None,
    prefill: Prefill = Prefill(),
    on_logprobs: LogprobCallback | None = None,
) -> GenerationResult:
    """Decode with chains of ``draft_len`` drafts per target forward.

    ``on_text`` streams the text; ``on_piece`` instead receives each piece with whether
    it came from accepted drafts (``--show-drafts``); ``prefill`` says how the prompt is read;
    ``on_logprobs`` receives each piece's log-probability entries before it (with ``config.logprobs``).
    """
    run = start(model, tokenizer, proposer, prompt_ids, config, draft_len + 1, on_text, on_piece, prefill, on_logprobs)
    cache, params, gen, tokens = run.cache, run.params, run.generator, run.tokens
    context = model.cfg.max_position_embeddings
    timed = proposer.timed if isinstance(proposer, Timed) else None
    while not run.sink.done:
        # never draft past the context window or far past the token budget
        n = max(0, min(draft_len, context - len(tokens) - 1, run.budget - len(run.sink.tokens)))
        with run.drafting():
            proposal = proposer.propose(tokens, n, params, gen)
        n_cached = cache.length
        chain = torch.tensor([tokens[-1]] + proposal.tokens.tolist(), device=model.device)
        t = time.perf_counter()
        out = model(chain[None], cache)
        logits = run.adjusted(out.logits[0], chain)
        if params.greedy:
            verdict = verify_greedy(proposal.tokens, logits)
        else:
            verdict = verify_sampling(proposal.tokens, proposal.probs, probabilities(logits, params), gen)
        if timed is not None:  # timed after the verdict, which waits for the forward on any device
            timed(len(chain), time.perf_counter() - t)
        new = proposal.tokens[: verdict.accepted].tolist() + [verdict.next_token]
        run.count(new)
        cache.truncate(n_cached + 1 + verdict.accepted)
        run.verified(out.hidden[0, : len(new)])
        tokens += new
        run.accepted.append(len(new))
        if not run.sink.push(new, drafted=verdict.accepted, scores=out.logits[0, : len(new)]):
            with run.drafting():
                proposer.commit(cache.length, hidden=out.hidden[0, : len(new)])
    return run.result()
