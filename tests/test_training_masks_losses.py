"""T-step-bounded masks, the staircase schedule and the distillation loss on hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moaspec.training.dataset import Batch
from moaspec.training.distill import masks_from_starts, simulate_chain, tli_mask
from moaspec.training.losses import distillation_loss, kl_target_to_draft
from moaspec.training.masks import (
    cross_attention_mask,
    cycle_starts,
    epoch_staircase_probability,
    periodic_starts,
    segment_starts,
    self_attention_mask,
    staircase_probability,
)
from moaspec.training.trainer import TrainConfig, lr_lambda


@pytest.mark.parametrize("seed", range(20))
def test_segments_cover_the_response_with_bounded_lengths(seed: int) -> None:
    P, S = 7, 120
    starts = segment_starts(P, S, torch.Generator().manual_seed(seed))
    assert starts[:P].tolist() == [0] * P
    bounds = sorted(set(starts[P:].tolist()))
    assert bounds[0] == P
    lengths = [b - a for a, b in zip(bounds, bounds[1:] + [S])]
    assert all(5 <= n <= 15 for n in lengths[:-1]) and 1 <= lengths[-1] <= 15
    for j in range(P, S):  # every position's start is the last boundary at or before it
        assert starts[j] == max(b for b in bounds if b <= j)


def test_lengths_are_uniform_over_5_to_15() -> None:
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(16)
    for _ in range(200):
        starts = segment_starts(0, 400, gen)
        b = sorted(set(starts.tolist()))
        for a, c in zip(b, b[1:]):
            counts[c - a] += 1
    assert counts[:5].sum() == 0
    freq = counts[5:] / counts[5:].sum()
    assert (freq - 1 / 11).abs().max() < 0.02


def test_a_share_of_long_segments_is_mixed_in() -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = []
    for _ in range(200):
        b = sorted(set(segment_starts(0, 400, gen, 5, 15, long_hi=64, long_fraction=0.25).tolist()))
        lengths += [c - a for a, c in zip(b, b[1:])]
    lengths_t = torch.tensor(lengths)
    assert lengths_t.min() >= 5 and lengths_t.max() <= 64 and lengths_t.max() > 60
    share = float((lengths_t > 15).float().mean())
    assert 0.22 < share < 0.28  # a quarter of the segments, drawn from 16..64
    long = lengths_t[lengths_t > 15].float()
    assert abs(float(long.mean()) - 40.0) < 1.5  # uniform over 16..64
    # without long segments the draws, and so a resumed older run, are exactly as before
    a = segment_starts(3, 200, torch.Generator().manual_seed(7))
    assert torch.equal(a, segment_starts(3, 200, torch.Generator().manual_seed(7), long_hi=64, long_fraction=0.0))
    with pytest.raises(ValueError, match="long_hi > hi"):
        segment_starts(0, 50, gen, 5, 15, long_hi=15, long_fraction=0.1)


def test_no_cross_attention_past_a_segment_start() -> None:
    P, S = 4, 40
    starts = segment_starts(P, S, torch.Generator().manual_seed(1))
    ca = cross_attention_mask(starts, P)
    for j in range(S):
        visible = ca[j].nonzero().flatten().tolist()
        if j < P:
            assert visible == list(range(j + 1))
        else:
            assert visible == list(range(int(starts[j])))  # everything verified before the cycle, nothing after


def test_hand_made_cross_attention_mask() -> None:
    starts = torch.tensor([0, 0, 2, 2, 2, 5, 5])
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
    ], dtype=torch.bool)
    assert torch.equal(cross_attention_mask(starts, 2), expected)


def test_hand_made_cross_attention_mask_with_segment_starts_in_memory() -> None:
    """--segment-start-in-memory (the authors' mask): a start reads memory up to and including itself, and the
    positions after it read up to the start, newest entry one token back at the first of them."""
    starts = torch.tensor([0, 0, 2, 2, 2, 5, 5])
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],  # prompt: causal, as without the option
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],  # start 2 reads its own entry: distance 0, which inference never shows
        [1, 1, 1, 0, 0, 0, 0],  # 3: newest entry 2, one back: inference's first draft after verifying 0..2
        [1, 1, 1, 0, 0, 0, 0],  # 4: its second draft
        [1, 1, 1, 1, 1, 1, 0],  # start 5 reads 0..5
        [1, 1, 1, 1, 1, 1, 0],  # 6: first draft after verifying 0..5
    ], dtype=torch.bool)
    inclusive = cross_attention_mask(starts, 2, inclusive=True)
    assert torch.equal(inclusive, expected)
    # each response row is the inference-exact row of a cycle that starts one position later
    exact = cross_attention_mask(starts, 2)
    assert torch.equal(inclusive[2:], exact[2:] | (torch.arange(7)[None, :] == starts[2:, None]))
    # a batch with one prompt length per sequence gives each sequence its own mask
    batched = cross_attention_mask(torch.stack([starts, starts]), torch.tensor([2, 2]), inclusive=True)
    assert torch.equal(batched[1], expected)


def test_tli_mask_follows_the_memory_a_position_reads() -> None:
    """TLI's true states reach as far as Cross-Attention's memory; a position never reads its own true state."""
    starts = torch.tensor([[0, 0, 2, 2, 2, 5, 5]])
    batch = Batch(torch.zeros(1, 7, dtype=torch.long), torch.tensor([7]), torch.tensor([2]))
    for inclusive, true_limit in ((False, [0, 1, 2, 2, 2, 5, 5]), (True, [0, 1, 2, 3, 3, 5, 6])):
        tm = tli_mask(masks_from_starts(batch, starts, torch.zeros(1, dtype=torch.bool), inclusive=inclusive),
                      batch.lengths)[0]
        for i in range(7):
            assert tm[i, :7].nonzero().flatten().tolist() == list(range(true_limit[i])), (inclusive, i)
            assert tm[i, 7:].nonzero().flatten().tolist() == list(range(true_limit[i], i + 1)), (inclusive, i)


@pytest.mark.parametrize("prompt_len", [0, 4, 13])
def test_periodic_segments_start_at_multiples_of_one_length_per_sequence(prompt_len: int) -> None:
    gen = torch.Generator().manual_seed(prompt_len)
    periods = []
    for _ in range(300):
        starts = periodic_starts(prompt_len, 80, gen, 6, 14)
        assert (starts[:prompt_len] == 0).all()
        bounds = sorted(set(starts[prompt_len:].tolist()))
        assert bounds[0] == prompt_len
        period = bounds[2] - bounds[1]
        assert 6 <= period <= 14
        assert all(b - a == period for a, b in zip(bounds[1:], bounds[2:]))  # one length for the whole sequence
        assert all(b % period == 0 for b in bounds[1:])  # the authors' i % every == 0
        assert bounds[1] - bounds[0] == period if prompt_len % period == 0 else bounds[1] - bounds[0] < period
        for j in range(prompt_len, 80):
            assert starts[j] == max(b for b in bounds if b <= j)
        periods.append(period)
    counts = torch.bincount(torch.tensor(periods), minlength=15)[6:].float()
    assert counts.min() > 0 and (counts / counts.sum() - 1 / 9).abs().max() < 0.06  # uniform over 6..14
    with pytest.raises(ValueError):
        periodic_starts(0, 10, gen, 3, 2)


def test_self_attention_masks() -> None:
    starts = torch.tensor([0, 0, 2, 2, 2, 5, 5])
    full = self_attention_mask(starts, local=False)
    assert torch.equal(full, torch.ones(7, 7, dtype=torch.bool).tril())
    local = self_attention_mask(starts, local=True)
    assert local[4].nonzero().flatten().tolist() == [2, 3, 4]
    assert local[6].nonzero().flatten().tolist() == [5, 6]
    assert local.diagonal().all()


@pytest.mark.parametrize("prompt_len,seq_len", [(3, 40), (7, 8), (5, 5)])
def test_cycle_starts_give_every_response_position_a_whole_segment(prompt_len: int, seq_len: int) -> None:
    L = 6
    owner = {}  # response position -> the phase whose segment starts there
    for phase in range(L):
        starts = cycle_starts(prompt_len, seq_len, L, phase)
        assert (starts[:prompt_len] == 0).all() and (starts[prompt_len:] >= prompt_len).all()
        assert (starts[prompt_len:] <= torch.arange(prompt_len, seq_len)).all()
        for s in range(prompt_len, seq_len):
            if (s - prompt_len) % L == phase:
                assert starts[s] == s and (starts[s : s + L] == s).all()  # the whole segment from s, cut by the end only
                owner[s] = phase
    assert sorted(owner) == list(range(prompt_len, seq_len))
    with pytest.raises(ValueError):
        cycle_starts(3, 10, L, L)


def test_simulated_chain_follows_the_cycles_real_decoding_runs() -> None:
    # a cycle starting at s accepts runs[s] drafts and adds the target's own token: the next one starts after both
    runs = [9, 9, 2, 0, 5, 1, 0, 3, 4, 0, 0, 0, 0, 0]
    assert simulate_chain(runs, prompt_len=2, answer_len=10) == [3, 2, 4]  # cycles start at 2, 5 and 7
    assert simulate_chain(runs, prompt_len=2, answer_len=8) == [3, 2, 3]  # the last drafts only what the budget leaves
    assert simulate_chain([6] * 20, prompt_len=0, answer_len=16, depth=6) == [7, 7, 2]  # at most depth drafts
    assert simulate_chain(runs, prompt_len=2, answer_len=1) == []  # the prefill wrote the only token


def test_staircase_schedule() -> None:
    assert staircase_probability(0, 1000) == 1.0
    assert staircase_probability(250, 1000) == pytest.approx(0.5)
    assert staircase_probability(500, 1000) == 0.0
    assert staircase_probability(900, 1000) == 0.0
    probs = [staircase_probability(s, 1000) for s in range(0, 501, 50)]
    assert all(a > b for a, b in zip(probs, probs[1:]))


def test_the_authors_staircase_over_pseudo_epochs() -> None:
    """--pseudo-epoch 100: local SA with probability 1 − e/20 in pseudo-epoch e, the whole first one local."""
    assert [epoch_staircase_probability(s, 100) for s in (0, 99, 100, 199, 200, 1000, 1999, 2000, 5000)] == \
        pytest.approx([1.0, 1.0, 0.95, 0.95, 0.9, 0.5, 0.05, 0.0, 0.0])
    with pytest.raises(ValueError):
        epoch_staircase_probability(0, 0)


@pytest.mark.parametrize("processes", [1, 2])
def test_peak_then_base_learning_rate_over_the_first_pseudo_epoch(processes: int) -> None:
    """--lr is the peak: warm-up to it, a linear fall to --lr/20 by the end of the first pseudo-epoch, then constant;
    counted in updates whatever the number of processes (Accelerate calls the scheduler once per process)."""
    f = lr_lambda(TrainConfig(steps=1000, warmup=10, pseudo_epoch=110), processes)
    factor = {step: f(step * processes) for step in (0, 4, 9, 10, 60, 109, 110, 500, 999)}
    assert factor == pytest.approx({0: 0.1, 4: 0.5, 9: 1.0, 10: 1.0, 60: 1 - 0.95 / 2, 109: 0.05 + 0.95 / 100,
                                    110: 0.05, 500: 0.05, 999: 0.05})
    # without --pseudo-epoch, the schedule of before: warm-up, then a cosine to min_lr_ratio
    default = lr_lambda(TrainConfig(steps=1000, warmup=10))
    assert (default(0), default(10), default(1000)) == pytest.approx((0.1, 1.0, 0.1))
    assert default(505) == pytest.approx(0.55)


def test_kl_on_hand_made_distributions() -> None:
    p = torch.tensor([[0.5, 0.5]])
    q = torch.tensor([[0.25, 0.75]])
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    got = kl_target_to_draft(p.log(), q.log())
    assert got.item() == pytest.approx(expected, rel=1e-5)
    assert kl_target_to_draft(p.log(), p.log()).item() == pytest.approx(0.0, abs=1e-7)


def test_distillation_loss_weights_and_tli_average() -> None:
    t_logits = torch.tensor([[2.0, 0.0, -1.0]])
    d_logits = torch.tensor([[0.0, 1.0, 0.0]])
    t_final, d_final = torch.zeros(1, 4), torch.tensor([[0.5, -0.5, 2.0, 0.0]])
    # smooth L1 (beta 1): 0.5*0.25, 0.5*0.25, 2-0.5, 0 -> mean = (0.125+0.125+1.5)/4
    final_l1 = (0.125 + 0.125 + 1.5) / 4
    parts = distillation_loss(t_logits, d_logits, [t_final], [d_final])
    kl = kl_target_to_draft(t_logits, d_logits).item()
    assert parts.feature.item() == pytest.approx(final_l1)
    assert parts.total.item() == pytest.approx(0.1 * kl + final_l1)
    t_mid, d_mid = torch.zeros(1, 4), torch.full((1, 4), 0.2)
    mid_l1 = 0.5 * 0.04
    tli = distillation_loss(t_logits, d_logits, [t_final, t_mid], [d_final, d_mid])
    assert tli.feature.item() == pytest.approx((final_l1 + mid_l1) / 2)
    assert F.smooth_l1_loss(d_mid, t_mid).item() == pytest.approx(mid_l1)


def test_loss_has_gradients_for_the_drafter_only() -> None:
    t_logits = torch.randn(5, 11)
    d_logits = torch.randn(5, 11, requires_grad=True)
    feat = torch.randn(5, 8, requires_grad=True)
    loss = distillation_loss(t_logits, d_logits, [torch.randn(5, 8)], [feat]).total
    loss.backward()
    assert d_logits.grad is not None and feat.grad is not None
    with pytest.raises(ValueError):
        distillation_loss(t_logits, d_logits, [], [])
