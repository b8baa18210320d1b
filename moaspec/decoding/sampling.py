"""Turning logits into tokens: pure functions, shared by every decoder.

Speculative sampling is only lossless if the drafter's and the target's distributions
are warped by exactly the same rule, so the rule lives here once: temperature, then
top-k, then top-p (nucleus), as in transformers' default warper order. Temperature 0
means greedy; its "distribution" is the one-hot of the argmax, which lets the same
acceptance code serve both modes.

OpenAI's presence and frequency penalties change the target's logits by what the
answer holds so far, so under speculation each verified row is penalised by the text
before *its* position: the answer, then the drafts on its path (:func:`path_counts`).
Its ``logit_bias`` adds the same to every row. Drafters draft without either; that
lowers acceptance, never exactness (speculative sampling is exact for any draft
distribution, greedy acceptance compares with the adjusted argmax).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from moaspec.errors import MoaspecError
from moaspec.validation import real_number, whole_number

MAX_LOGIT_BIAS = 1024  # entries in a logit bias (OpenAI allows 300)


@dataclass(frozen=True)
class SamplingParams:
    """How to choose each token. ``temperature == 0`` is greedy decoding."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0  # subtracted from the logit of every token the answer already holds
    frequency_penalty: float = 0.0  # subtracted once per time the answer already holds the token
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit): OpenAI's logit_bias

    def __post_init__(self) -> None:
        if not (real_number(self.temperature) and self.temperature >= 0):
            raise MoaspecError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (whole_number(self.top_k) and self.top_k >= 0):
            raise MoaspecError(f"top_k must be a whole number >= 0 (0 disables it), got {self.top_k!r}")
        if not (real_number(self.top_p) and 0 < self.top_p <= 1):
            raise MoaspecError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (whole_number(self.seed) and 0 <= self.seed < 2**63):
            raise MoaspecError(f"seed must be a whole number in 0..2**63-1, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (real_number(value) and -2 <= value <= 2):
                raise MoaspecError(f"{name} must be a number in [-2, 2] (OpenAI's range), got {value!r}")
        if not isinstance(self.logit_bias, tuple) or len(self.logit_bias) > MAX_LOGIT_BIAS or not all(
                isinstance(e, tuple) and len(e) == 2 and whole_number(e[0]) and e[0] >= 0 and real_number(e[1])
                and -100 <= e[1] <= 100 for e in self.logit_bias):
            raise MoaspecError(f"logit_bias takes at most {MAX_LOGIT_BIAS} (token id, bias) pairs, each bias in "
                               f"[-100, 100], got {self.logit_bias!r}")

    @property
    def penalized(self) -> bool:
        """Whether the target's logits change by the answer so far (presence or frequency penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty)

    @property
    def adjusted(self) -> bool:
        """Whether the target's logits change before choosing: penalties or a logit bias."""
        return self.penalized or bool(self.logit_bias)

    @cached_property
    def _bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids, values = zip(*self.logit_bias)
        return torch.tensor(ids), torch.tensor(values, dtype=torch.float32)

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuse a logit bias for a token the target does not have."""
        bad = next((t for t, _ in self.logit_bias if t >= vocab_size), None)
        if bad is not None:
            raise MoaspecError(f"logit_bias names token {bad}, outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator seeded with ``seed`` (or from the OS when no seed is given)."""
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p along the last axis; removed entries become -inf.

    The largest logit is subtracted before dividing by the temperature (softmax does not
    change): a very small temperature then sends the others to -inf instead of sending
    every logit to ±inf, whose softmax would be NaN.
    """
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the tokens ranked before it already reach top_p (the top one always stays)
        drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def adjust(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Logits plus the logit bias, less the presence and frequency penalties for tokens the answer holds ``counts``
    times (``[..., V]``; None: the answer is empty); unchanged without either."""
    if not params.adjusted:
        return logits
    logits = logits.float()
    if params.penalized and counts is not None:
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    if params.logit_bias:
        ids, values = params._bias
        logits = logits + torch.zeros(logits.shape[-1], device=logits.device).index_add_(
            0, ids.to(logits.device), values.to(logits.device))
    return logits


def logit_bias_pairs(mapping: Mapping[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids written as strings → bias) as (token id, bias) pairs for
    :class:`SamplingParams`; JSON's keys are strings, so the ids are read from them here."""
    pairs = []
    for key, value in (mapping or {}).items():
        if not (key.isascii() and key.isdigit() and int(key) < vocab_size):
            raise MoaspecError(f"logit_bias keys are token ids in [0, {vocab_size}), got {key!r}")
        pairs.append((int(key), value))
    if len(pairs) > MAX_LOGIT_BIAS:
        raise MoaspecError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens")
    return tuple(pairs)


def count_tokens(counts: torch.Tensor | None, tokens: Sequence[int]) -> None:
    """Add ``tokens`` to an answer's token ``counts`` ``[V]`` in place (None, without penalties: nothing to do)."""
    if counts is not None and len(tokens):
        counts.index_add_(0, torch.tensor(list(tokens), device=counts.device),
                          torch.ones(len(tokens), device=counts.device))


def answer_counts(params: SamplingParams, vocab_size: int, device: torch.device | str,
                  answer: Sequence[int] = ()) -> torch.Tensor | None:
    """How often each token occurs in ``answer`` (``[V]``), what the penalties read; None without penalties."""
    if not params.penalized:
        return None
    counts = torch.zeros(vocab_size, device=device)
    count_tokens(counts, answer)
    return counts


def adjust_rows(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None, nodes: torch.Tensor,
                ancestors: torch.Tensor | None = None) -> torch.Tensor:
    """A verification's logits ``[N, V]`` with the logit bias and the penalties, each row penalised by the text
    before it: the answer's ``counts`` (None: no penalties), then the ``nodes`` (the verified tokens, the answer's
    newest first) on its path; ``ancestors`` as a tree's, None for a chain, where each node is below the one before."""
    if counts is None:
        return adjust(logits, params)
    if ancestors is None:
        ancestors = torch.ones(len(nodes), len(nodes), dtype=torch.bool).tril()
    return adjust(logits, params, path_counts(counts, nodes, ancestors))


def path_counts(counts: torch.Tensor, tokens: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """Token counts of the answer before each verified row: ``[N, V]`` from the answer's ``counts`` ``[V]``.

    ``tokens`` ``[N]`` are a verification's tokens, node 0 the newest token of the answer
    (already in ``counts``); ``ancestors[i, j]`` says node ``j`` is node ``i`` or above it
    (a chain's is lower-triangular). Row ``i`` scores the token after node ``i``, so it
    counts the drafts from the root's child down to node ``i``.
    """
    path = ancestors.to(counts.device, torch.float32).clone()
    path[:, 0] = 0
    return counts + path @ torch.nn.functional.one_hot(tokens.to(counts.device), counts.shape[-1]).float()


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution tokens are drawn from: one-hot argmax when greedy, else softmax of the warped logits."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    return warp_logits(logits, params).softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of ``probs`` ``[..., V]`` → token ids ``[...]``."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def select_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Choose one token per row of ``logits`` ``[..., V]`` → ids ``[...]``."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return sample(probabilities(logits, params), generator)


def select_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Choose the next token from one logits vector ``[V]``."""
    return int(select_tokens(logits, params, generator))
