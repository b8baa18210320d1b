"""The narrow interface between "propose candidates" and "verify them".

A proposer sees the verified token sequence and the target's cache (read-only, except
for the positions beyond the verified length, which the next verification overwrites)
and proposes draft tokens with the distribution each was drawn from. The decoding loop
verifies them and tells the proposer how much was kept. Any drafter that fits these
three calls plugs into every decoding loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from moaspec.decoding.sampling import SamplingParams
from moaspec.errors import MoaspecError
from moaspec.models.kv_cache import KVCache


@dataclass
class Proposal:
    tokens: torch.Tensor  # [T] target token ids
    probs: torch.Tensor | None  # [T, V] the distributions they were drawn from (None when greedy)


class Proposer(Protocol):
    def begin(self, target_cache: KVCache, hidden: torch.Tensor) -> None:
        """A new sequence: the target has just prefilled its prompt into ``target_cache``.

        ``hidden`` ``[P, d]`` is the target's final hidden state at every prompt position.
        """

    def propose(self, tokens: Sequence[int], n: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        """Draft up to ``n`` tokens after ``tokens`` (verified tokens, ending with the target's newest one).

        Fewer is allowed (a chain that ends where the drafter is unsure): the loop verifies what comes.
        """

    def commit(self, verified: int, path: Sequence[int] | None = None, hidden: torch.Tensor | None = None) -> None:
        """The first ``verified`` tokens are now verified and in the target's cache; forget the rest.

        ``path``: for a tree, the accepted nodes (``None`` for a chain's accepted prefix).
        ``hidden``: the target's final hidden states of the newly verified tokens.
        """


@runtime_checkable
class Resumable(Protocol):
    """A proposer that may begin from what an earlier generation left in a prompt cache.

    Its state per verified position (MoA: SA's K/V of the token, CA's keys/values of the
    memory entry) depends on nothing but that position's token and the target's K/V there,
    so a conversation's next turn can reuse it wherever it reuses the target's K/V.
    A proposer without it (a test's stub, prompt lookup alone) simply starts afresh.
    """

    def state_name(self) -> str | None:
        """What its state is stored under (naming the drafter exactly); None: it keeps none."""

    def begin(self, target_cache: KVCache, hidden: torch.Tensor, known: torch.Tensor | None = None) -> None:
        """As :meth:`Proposer.begin`, starting from ``known``: rows that :meth:`kept` gave for the first positions."""

    def kept(self) -> torch.Tensor | None:
        """Its state of the first verified positions, one row each, to store when the generation ends."""


@runtime_checkable
class Timed(Protocol):
    """A proposer that decides by what verification costs (:mod:`moaspec.decoding.policy`): the loop tells it how
    long each verification of its proposal took."""

    def timed(self, new: int, seconds: float) -> None:
        """The target's forward over ``new`` new tokens, and the verification after it, took ``seconds``."""


def check_confidence(p: float) -> float:
    """A draft confidence is a probability below 1 (a chain always keeps its first draft); 0 turns it off."""
    if not 0 <= p < 1:
        raise MoaspecError(f"a draft confidence is a probability in [0, 1) (0: off), got {p}")
    return p
