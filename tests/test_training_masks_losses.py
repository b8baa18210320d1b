"""T-step-bounded masks, the staircase schedule and the distillation loss on hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moaspec.training.distill import simulate_chain
from moaspec.training.losses import distillation_loss, kl_target_to_draft
from moaspec.training.masks import (
    cross_attention_mask,
    cycle_starts,
    segment_starts,
    self_attention_mask,
    staircase_probability,
)


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
