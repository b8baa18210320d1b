"""One distillation step's arithmetic: target features, T-step-bounded masks, drafter loss, acceptance.

Kept apart from the training loop (:mod:`moaspec.training.trainer`) so that it can be
read — and tested — on its own: given a batch of sequences, the frozen target
produces every layer's K/V (the LSA input), its final hidden states and, with Target
Layer Inference, its states after layer L−N; the drafter predicts them under the
masks that imitate inference; the loss compares the two on response positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moaspec.drafters.base import Drafter
from moaspec.drafters.eagle import EagleDrafter
from moaspec.drafters.independent import IndependentDrafter
from moaspec.drafters.moa import MoADrafter
from moaspec.models.kv_cache import KVCache
from moaspec.models.transformer import Transformer
from moaspec.training.dataset import Batch
from moaspec.training.features import TargetOut
from moaspec.training.losses import FEATURE_WEIGHT, KL_WEIGHT, LossParts, distillation_loss
from moaspec.training.masks import (
    cross_attention_mask,
    cycle_starts,
    periodic_starts,
    segment_starts,
    self_attention_mask,
)


@dataclass
class Masks:
    sa: torch.Tensor  # [B, S, S]
    ca: torch.Tensor  # [B, S, S]
    starts: torch.Tensor  # [B, S] segment start of each position
    loss: torch.Tensor  # [B, S] response positions of real tokens
    inclusive: bool = False  # a segment start reads its own memory entry (the authors' training mask; never inference's)


def build_masks(batch: Batch, generator: torch.Generator, local_sa: torch.Tensor, lo: int = 5, hi: int = 15,
                device: torch.device | str = "cpu", long_hi: int = 0, long_fraction: float = 0.0,
                inclusive: bool = False, periodic: bool = False) -> Masks:
    """Training masks: response segments of lengths drawn uniformly from ``lo..hi``
    (a ``long_fraction`` of them from ``hi+1..long_hi``: :func:`segment_starts`; ``periodic``: one
    length per sequence, :func:`periodic_starts`). ``inclusive``: segment starts read their own
    memory entry (:func:`cross_attention_mask`). The defaults are inference's masks, which every
    evaluation uses.

    Segment starts are drawn on the CPU (one generator, so a resumed run draws the same
    ones); the masks themselves are built on ``device`` (:func:`masks_from_starts`).
    """
    B, S = batch.tokens.shape
    starts = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        p, n = int(batch.prompt_lens[b]), int(batch.lengths[b])
        starts[b, :n] = periodic_starts(p, n, generator, lo, hi) if periodic else \
            segment_starts(p, n, generator, lo, hi, long_hi, long_fraction)
    return masks_from_starts(batch, starts, local_sa, device, inclusive)


def masks_from_starts(batch: Batch, starts: torch.Tensor, local_sa: torch.Tensor, device: torch.device | str = "cpu",
                      inclusive: bool = False) -> Masks:
    """Masks for given segment starts (``[B, S]``), padded to the batch; padding rows see position 0 so that no row is empty.

    The ``[B, S, S]`` masks are built on ``device`` for the whole batch at once: for a
    16 k-token batch, building them row by row on a CPU core took ~0.1 s, against a
    ~0.4 s GPU step.
    """
    S = batch.tokens.shape[1]
    pos = torch.arange(S)
    loss = (pos[None, :] >= batch.prompt_lens[:, None]) & (pos[None, :] < batch.lengths[:, None])
    st = starts.to(device)
    real = (torch.arange(S, device=st.device)[None, :] < batch.lengths.to(device)[:, None])[:, :, None]
    sa = self_attention_mask(st, local_sa.to(device)) & real
    ca = cross_attention_mask(st, batch.prompt_lens.to(device), inclusive) & real
    sa[:, :, 0] |= ~sa.any(-1)
    ca[:, :, 0] |= ~ca.any(-1)
    return Masks(sa, ca, starts, loss, inclusive)


def tli_mask(masks: Masks, lengths: torch.Tensor) -> torch.Tensor:
    """``[B, S, 2S]`` for TLI in training: true states where Cross-Attention's memory reaches (before each
    position's segment start, or up to it with ``masks.inclusive``), predicted ones after.

    Keys ``0..S-1`` are the target's true K/V of the last N layers, keys ``S..2S-1``
    the ones computed from the drafter's predictions — as at inference, where the
    target's cache holds verified positions and the drafter writes drafted ones.
    A position never reads its own true state: prompt positions, and with ``inclusive``
    segment starts, see true states before themselves and their own prediction.
    """
    B, S = masks.starts.shape
    pos = torch.arange(S)
    verified = torch.minimum(masks.starts + int(masks.inclusive), pos)  # the verified states inference would hold
    limit = torch.where(masks.loss, verified, pos[None, :].expand(B, S))  # [B, S]
    true_part = pos[None, None, :] < limit[:, :, None]
    pred_part = (pos[None, None, :] >= limit[:, :, None]) & (pos[None, None, :] <= pos[None, :, None])
    real = pos[None, :] < lengths[:, None]
    return torch.cat([true_part & real[:, None, :], pred_part & real[:, None, :]], dim=-1)


@dataclass
class StepOut:
    loss: LossParts
    draft_logits: torch.Tensor  # [n, K] at loss positions
    target_logits: torch.Tensor  # [n, K]


def drafter_loss(drafter: Drafter, target: Transformer, batch: Batch, masks: Masks, tgt: TargetOut,
                 wrapped: torch.nn.Module | None = None, kl_weight: float = KL_WEIGHT,
                 feature_weight: float = FEATURE_WEIGHT) -> StepOut:
    """The paper's loss on response positions (its weights unless others are given); with N > 0 the feature
    term averages both states.

    ``wrapped`` is the drafter as the training framework wrapped it (DDP): its forward
    must be the one called so that gradients are synchronised. An EAGLE drafter gets
    the same loss, teacher-forced on the target's features as EAGLE trains; an
    independent drafter gets it too, reading tokens only.
    """
    draft_feats, target_feats = predicted_features(drafter, target, batch, masks, tgt, wrapped)
    draft_logits = drafter.head(draft_feats[0])
    with torch.no_grad():
        target_logits = drafter.head(target_feats[0])
    loss = distillation_loss(target_logits, draft_logits, target_feats, draft_feats, kl_weight, feature_weight)
    return StepOut(loss, draft_logits, target_logits)


def loss_rows(masks: Masks, device: torch.device) -> torch.Tensor:
    """The flat indices of the loss positions, found on the CPU (where ``masks.loss`` is) and sent to ``device``:
    selecting rows by index lets a GPU go on without the wait that a boolean mask's unknown count costs."""
    return masks.loss.flatten().nonzero().squeeze(1).to(device, non_blocking=True)


def predicted_features(drafter: Drafter, target: Transformer, batch: Batch, masks: Masks, tgt: TargetOut,
                       wrapped: torch.nn.Module | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(drafter's, target's) features at response positions: the final state first, then with N > 0 layer L−N's."""
    device = tgt.final.device
    rows = loss_rows(masks, device)

    def sel(t: torch.Tensor) -> torch.Tensor:  # t[masks.loss], in the same order
        return t.flatten(0, 1).index_select(0, rows)

    if isinstance(drafter, EagleDrafter):
        pred = (wrapped or drafter)(batch.tokens.to(device), tgt.final)
    elif isinstance(drafter, IndependentDrafter):
        pred = (wrapped or drafter)(batch.tokens.to(device))
    else:
        assert isinstance(drafter, MoADrafter)
        pred = (wrapped or drafter)(batch.tokens.to(device), tgt.token_kv, tgt.final,
                                    masks.sa.to(device), masks.ca.to(device))
    N = drafter.cfg.tli_layers if isinstance(drafter, MoADrafter) else 0
    if not N:
        return [sel(pred)], [sel(tgt.final)]
    assert isinstance(drafter, MoADrafter) and tgt.layer is not None
    B, S = batch.tokens.shape
    L = target.cfg.num_layers
    H, D = target.cfg.num_kv_heads, target.cfg.head_dim
    cache = KVCache(N, H, D, 2 * S, B, pred.dtype, device)
    cache.put_token_kv(0, tgt.token_kv[:, :, L - N :])  # the last N layers' true K/V
    final = drafter.run_tli(pred, cache, torch.arange(S, device=device), tli_mask(masks, batch.lengths).to(device))
    return [sel(final), sel(pred)], [sel(tgt.final), sel(tgt.layer)]


def acceptance_by_offset(draft_logits: torch.Tensor, target_full_argmax: torch.Tensor,
                         to_target_ids: Callable[[torch.Tensor], torch.Tensor], masks: Masks,
                         depth: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced chain acceptance: per segment, how many leading drafts (up to ``depth``) match the target.

    Returns (sum of accepted lengths, number of segments) so that callers can
    aggregate over batches and processes. ``target_full_argmax`` is the target's greedy
    token over its whole vocabulary: a token outside the draft vocabulary is a miss.
    """
    match = (to_target_ids(draft_logits.argmax(-1)) == target_full_argmax).cpu()
    starts = masks.starts[masks.loss]
    pos = torch.nonzero(masks.loss)[:, 1]
    batch_idx = torch.nonzero(masks.loss)[:, 0]
    offset = pos - starts
    key = batch_idx * (masks.starts.shape[1] + 1) + starts
    segments = torch.unique(key)
    total = torch.zeros(())
    for s in segments.tolist():
        in_seg = key == s
        m = match[in_seg][offset[in_seg].argsort()][:depth]
        run = int(m.long().cumprod(0).sum())
        total += run
    return total, torch.tensor(float(len(segments)))


def full_argmax(target: Transformer, final: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return F.linear(final, target.lm_head.weight).argmax(-1)


def accepted_runs(matches: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``[B, S]``: how many drafts a greedy chain would accept in a cycle starting at each response position
    (its leading matched steps, from :func:`step_matches`); 0 outside responses.

    Along the target's greedy output a cycle's drafts read the true tokens up to the
    first miss, so every cycle can be computed teacher-forced, all positions at once;
    :func:`simulate_chain` then follows the cycles real decoding would run.
    """
    run = torch.zeros(matches.shape[1:], dtype=torch.long)
    alive = response_mask(batch)
    for step in matches:
        alive &= step
        run += alive
    return run


def response_mask(batch: Batch) -> torch.Tensor:
    """``[B, S]``: positions of response tokens."""
    pos = torch.arange(batch.tokens.shape[1])
    return (pos[None, :] >= batch.prompt_lens[:, None]) & (pos[None, :] < batch.lengths[:, None])


def step_matches(drafter: Drafter, target: Transformer, batch: Batch, tgt: TargetOut, greedy: torch.Tensor,
                 depth: int = 6) -> torch.Tensor:
    """``[depth, B, S]`` bool (CPU): whether step ``k`` of the drafting cycle that starts at position ``n`` drafts
    the target's greedy token at ``n + k``, its inputs being the true tokens (as along greedy output until a miss).

    ``greedy`` is the target's greedy token at each response position (:func:`full_argmax`);
    entries whose position ``n + k`` is not a response token are False. How a step depends
    on where its cycle starts is the drafter's: see :func:`_moa_step_matches` and
    :meth:`EagleDrafter.unrolled`; an independent drafter reads tokens only, so one pass
    serves every step.
    """
    if isinstance(drafter, MoADrafter):
        return _moa_step_matches(drafter, target, batch, tgt, greedy, depth)
    B, S = batch.tokens.shape
    device = tgt.final.device
    response = response_mask(batch)
    if isinstance(drafter, EagleDrafter):
        steps = drafter.unrolled(batch.tokens.to(device), tgt.final, depth)
    else:
        assert isinstance(drafter, IndependentDrafter)
        steps = [drafter(batch.tokens.to(device))]
    by_position = []
    for feats in steps:
        match = torch.zeros(B, S + depth, dtype=torch.bool)
        match[:, :S][response] = (drafter.to_target_ids(drafter.head(feats[response.to(device)]).argmax(-1)) == greedy).cpu()
        by_position.append(match)
    if len(by_position) == 1:  # the independent drafter's one pass, for every step
        by_position *= depth
    return torch.stack([by_position[k][:, k : k + S] for k in range(depth)])  # step k of the cycle at n sits at n + k


def _moa_step_matches(drafter: MoADrafter, target: Transformer, batch: Batch, tgt: TargetOut, greedy: torch.Tensor,
                      depth: int) -> torch.Tensor:
    """:func:`step_matches` for MoA, whose cycle depends only on where it starts.

    Its memory holds the target's states before that position, so ``depth`` passes,
    each with segments of ``depth`` positions shifted by one position from the last,
    give every position's cycle.
    """
    B, S = batch.tokens.shape
    device = tgt.final.device
    pos = torch.arange(S)
    out = torch.zeros(depth, B, S, dtype=torch.bool)
    for phase in range(depth):
        starts = torch.zeros(B, S, dtype=torch.long)
        for b in range(B):
            starts[b, : int(batch.lengths[b])] = cycle_starts(int(batch.prompt_lens[b]), int(batch.lengths[b]), depth, phase)
        masks = masks_from_starts(batch, starts, torch.zeros(B, dtype=torch.bool), device)
        draft_logits = drafter.head(predicted_features(drafter, target, batch, masks, tgt)[0][0])
        match = torch.zeros(B, S + depth, dtype=torch.bool)
        match[:, :S][masks.loss] = (drafter.to_target_ids(draft_logits.argmax(-1)) == greedy).cpu()
        first = masks.loss & (starts == pos) & ((pos[None, :] - batch.prompt_lens[:, None]) % depth == phase)
        for k in range(depth):  # a segment of this phase holds its start and the depth - 1 positions after it
            out[k][first] = match[:, k : k + S][first]
    return out


def step_accuracy(matches: torch.Tensor, batch: Batch, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(hits, cases) per cycle step ``[depth]`` from :func:`step_matches`: how often step ``k`` drafts the
    target's token when the steps before it were right (its inputs are the true tokens).

    A cycle's first step reads the target's freshest state; later ones draft further
    from it, so a drafter that reads its memory well is most accurate at step 0.
    ``rows`` (bool ``[B]``) limits the count to some sequences, such as greedy answers.
    """
    response = response_mask(batch)
    if rows is not None:
        response &= rows[:, None]
    depth, _, S = matches.shape
    later = torch.cat([response, torch.zeros_like(response[:, :depth])], dim=1)
    cases = torch.stack([(response & later[:, k : k + S]).sum() for k in range(depth)])
    return (matches & response).flatten(1).sum(1), cases


def simulate_chain(runs: Sequence[int], prompt_len: int, answer_len: int, depth: int = 6) -> list[int]:
    """Tokens that each verification adds when greedy chains of ``depth`` drafts write ``answer_len`` tokens.

    ``runs[s]`` is what a cycle starting at position ``s`` accepts (:func:`accepted_runs`).
    The first token comes from the prefill; then each cycle drafts at most what is left
    of the budget, as :func:`moaspec.decoding.speculative.generate_chain` does, and
    adds its accepted drafts plus the target's own token.
    """
    added, made, s = [], 1, prompt_len
    while made < answer_len:
        n = min(runs[s], depth, answer_len - made) + 1
        added.append(n)
        made, s = made + n, s + n
    return added
