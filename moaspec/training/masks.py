"""Training masks that make the MoA drafter T-step bounded (DESIGN-FACTS §2).

At inference, after a verification the target's states are known for every token
before the target's own new token, and the drafter then drafts several tokens from
that fixed memory. Training imitates this: each response is cut into segments of
random length (uniform in 5..15); a position may cross-attend only to target states
*before its segment's start*, exactly as a drafted token sees only states verified
before the current drafting cycle. The prompt is verified in one go, so it is a
segment of its own, and the first response segment starts at the first response token.

``moaspec train --segment-start-in-memory`` trains with the authors' mask instead
(:func:`cross_attention_mask` with ``inclusive``): a segment's first position also reads
its own memory entry, so the positions after it read memory up to one token back, as
inference's first draft does. The held-out evaluation keeps the inference-exact mask.
"""

from __future__ import annotations

import torch


def segment_starts(prompt_len: int, seq_len: int, generator: torch.Generator, lo: int = 5, hi: int = 15,
                   long_hi: int = 0, long_fraction: float = 0.0) -> torch.Tensor:
    """``[seq_len]``: the start of the segment each position belongs to (0 for prompt positions).

    Response segments have lengths drawn uniformly from ``lo..hi``; the last one is cut
    by the end of the sequence. With ``long_fraction > 0``, that share of segments is
    drawn from ``hi+1..long_hi`` instead: longer stretches without new target states,
    which a client generating alone after a disconnection lives in, mixed into the
    usual ones rather than replacing them (replacing them cost online acceptance).
    """
    if not 1 <= lo <= hi:
        raise ValueError(f"segment lengths need 1 <= lo <= hi, got {lo}..{hi}")
    if not 0.0 <= long_fraction < 1.0 or (long_fraction > 0 and long_hi <= hi):
        raise ValueError(f"long segments need a fraction in [0, 1) and long_hi > hi, got {long_fraction} and {long_hi}")
    starts = torch.zeros(seq_len, dtype=torch.long)
    s = prompt_len
    while s < seq_len:
        if long_fraction > 0 and float(torch.rand((), generator=generator)) < long_fraction:
            n = int(torch.randint(hi + 1, long_hi + 1, (1,), generator=generator))
        else:
            n = int(torch.randint(lo, hi + 1, (1,), generator=generator))
        starts[s : s + n] = s
        s += n
    return starts


def cycle_starts(prompt_len: int, seq_len: int, length: int, phase: int) -> torch.Tensor:
    """``[seq_len]``: response segments of ``length`` positions, starting at ``prompt_len + phase`` (mod ``length``).

    A position before the first such start belongs to a shorter segment from
    ``prompt_len``. The ``length`` phases together give every response position a
    whole segment that starts there, which is what evaluating real decoding needs
    (:func:`moaspec.training.distill.step_matches`).
    """
    if not 0 <= phase < length:
        raise ValueError(f"phase must be in 0..{length - 1}, got {phase}")
    starts = torch.zeros(seq_len, dtype=torch.long)
    rel = torch.arange(seq_len) - prompt_len - phase
    starts[prompt_len:] = prompt_len
    starts[rel >= 0] = (prompt_len + phase + rel.div(length, rounding_mode="floor") * length)[rel >= 0]
    return starts


def periodic_starts(prompt_len: int, seq_len: int, generator: torch.Generator, lo: int = 5, hi: int = 15) -> torch.Tensor:
    """``[seq_len]``: segment starts with one period per sequence, as the authors' code cuts them.

    The period is drawn uniformly from ``lo..hi`` once for the sequence, and every
    response position that is a multiple of it starts a segment (their ``i % every == 0``);
    the response positions before the first multiple form a shorter segment from
    ``prompt_len``. One draw from ``generator`` per sequence.
    """
    if not 1 <= lo <= hi:
        raise ValueError(f"segment lengths need 1 <= lo <= hi, got {lo}..{hi}")
    period = int(torch.randint(lo, hi + 1, (1,), generator=generator))
    return cycle_starts(prompt_len, seq_len, period, -prompt_len % period)


def cross_attention_mask(starts: torch.Tensor, prompt_len: int | torch.Tensor, inclusive: bool = False) -> torch.Tensor:
    """``[..., S, S]`` bool, query × memory: response positions see memory strictly before their segment start
    (``inclusive``: up to and including it).

    Prompt positions (no loss there) see the memory causally, so that no row is empty.
    ``starts`` is ``[..., S]`` (one sequence or a batch, with ``prompt_len`` one per
    sequence), built on ``starts``' device so that a GPU run never ships masks over PCIe.

    Strictly before is inference's picture: a cycle's first draft reads the token the
    target has just produced, whose state is not verified yet, so the segment start is
    the first draft (distance 1 from the newest entry). ``inclusive`` is the authors'
    training mask: the segment start reads its own entry (distance 0, which inference
    never shows), and the positions after it are the cycle's drafts, the first of them
    one position after the start; a segment of n positions then trains n − 1 drafts.
    """
    S = starts.shape[-1]
    pos = torch.arange(S, device=starts.device)
    p = torch.as_tensor(prompt_len, device=starts.device)[..., None]
    limit = torch.where(pos < p, pos + 1, starts + int(inclusive))  # memory positions < limit are visible
    return pos < limit[..., None]


def self_attention_mask(starts: torch.Tensor, local: bool | torch.Tensor) -> torch.Tensor:
    """``[..., S, S]`` causal mask for SA; ``local`` (per sequence) keeps each position inside its own segment (staircase)."""
    S = starts.shape[-1]
    causal = torch.ones(S, S, dtype=torch.bool, device=starts.device).tril()
    same = starts[..., :, None] == starts[..., None, :]
    return causal & (same | ~torch.as_tensor(local, device=starts.device)[..., None, None])


def staircase_probability(step: int, total_steps: int) -> float:
    """Probability that SA is restricted to the current segment: 1 at the start, 0 from half of training on."""
    half = max(1, total_steps // 2)
    return max(0.0, 1.0 - step / half)


# the authors' staircase falls by 1/20 per epoch (their 1 − epoch/(max_epochs/2) with 40 epochs)
STAIRCASE_EPOCHS = 20


def epoch_staircase_probability(step: int, epoch_updates: int) -> float:
    """The authors' staircase over pseudo-epochs of ``epoch_updates`` updates: ``max(0, 1 − e/20)`` in pseudo-epoch
    ``e = step // epoch_updates``, so SA is local for the whole first one and never from the twentieth on."""
    if epoch_updates < 1:
        raise ValueError(f"a pseudo-epoch needs at least 1 update, got {epoch_updates}")
    return max(0.0, 1.0 - (step // epoch_updates) / STAIRCASE_EPOCHS)
