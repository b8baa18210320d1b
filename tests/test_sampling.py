"""Token selection rules, tested as pure functions."""

from __future__ import annotations

import pytest
import torch

from moaspec.decoding.sampling import SamplingParams, probabilities, sample, select_token, warp_logits
from moaspec.errors import MoaspecError

LOGITS = torch.log(torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]))


def test_greedy_is_one_hot_argmax() -> None:
    p = probabilities(LOGITS, SamplingParams())
    assert p.tolist() == [0, 1, 0, 0, 0]
    assert select_token(LOGITS, SamplingParams(), None) == 1


def test_temperature_one_keeps_distribution() -> None:
    p = probabilities(LOGITS, SamplingParams(temperature=1.0))
    torch.testing.assert_close(p, torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]))


def test_top_k_keeps_k_best_renormalised() -> None:
    p = probabilities(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([0, 0.4 / 0.7, 0, 0.3 / 0.7, 0]))


def test_top_p_keeps_smallest_nucleus() -> None:
    # sorted: 0.4, 0.3, 0.15, 0.1, 0.05; 0.4+0.3 = 0.7 < 0.75 so 0.15 is needed too
    p = probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.75))
    torch.testing.assert_close(p, torch.tensor([0, 0.4, 0, 0.3, 0.15]) / 0.85)
    # a nucleus reached exactly stops there
    p = probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([0, 0.4, 0, 0.3, 0]) / 0.7)
    # the top token always survives
    p = probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.01))
    assert p.tolist() == [0, 1, 0, 0, 0]


def test_low_temperature_sharpens() -> None:
    p = probabilities(LOGITS, SamplingParams(temperature=0.1))
    assert p[1] > 0.9


def test_warp_works_on_batches() -> None:
    batch = torch.stack([LOGITS, LOGITS.flip(0)])
    w = warp_logits(batch, SamplingParams(temperature=1.0, top_k=1))
    assert torch.isfinite(w).sum(dim=-1).tolist() == [1, 1]


def test_sampling_is_seeded_and_follows_distribution() -> None:
    params = SamplingParams(temperature=1.0, seed=123)
    probs = probabilities(LOGITS, params)
    draws = sample(probs.expand(20000, -1), params.generator())
    again = sample(probs.expand(20000, -1), params.generator())
    assert torch.equal(draws, again)
    freq = torch.bincount(draws, minlength=5).float() / 20000
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


def test_a_vanishing_temperature_samples_the_argmax() -> None:
    """Temperatures so small that logits / T overflow still give a distribution (all mass on the argmax, shared
    between exact ties), not NaN, for large logits too."""
    for t in (1e-45, 1e-30, 1e-8):
        p = probabilities(LOGITS * 1000, SamplingParams(temperature=t))
        assert p.tolist() == [0, 1, 0, 0, 0]
        assert select_token(LOGITS, SamplingParams(temperature=t, seed=0), SamplingParams(seed=0).generator()) == 1
    tie = probabilities(torch.tensor([1.0, 3.0, 3.0]), SamplingParams(temperature=1e-45))
    assert tie.tolist() == [0, 0.5, 0.5]


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"temperature": float("inf")}, {"temperature": float("nan")},
                                    {"top_k": -2}, {"top_p": 0}, {"top_p": 1.5}, {"top_p": float("nan")}])
def test_invalid_params_are_refused(kwargs) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MoaspecError):
        SamplingParams(**kwargs)
