"""Batched generation (for distillation data) equals one-by-one generation."""

from __future__ import annotations

import torch

from moaspec.decoding import GenerationConfig, generate
from moaspec.decoding.batched import generate_batch
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.vanilla import stop_token_ids


def test_greedy_batch_equals_single_generation(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    lm = tiny_llama
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, lm.cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 9, 1)]
    eos = stop_token_ids(lm.model, lm.tokenizer)
    batch = generate_batch(lm.model, prompts, 30, SamplingParams(), eos)
    for p, (toks, stopped) in zip(prompts, batch):
        single = generate(lm.model, lm.tokenizer, p, GenerationConfig(max_new_tokens=30))
        assert toks == single.token_ids
        assert stopped == (single.finish_reason == "eos")


def test_rows_finish_independently(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """A stop id that some rows hit early: they leave the batch, the others go on unchanged."""
    lm = tiny_llama
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    free = generate_batch(lm.model, prompts, 12, SamplingParams(), set())
    stop = free[1][0][2]  # row 1's third token becomes a stop id
    capped = generate_batch(lm.model, prompts, 12, SamplingParams(), {stop})
    for (full, _), (cut, stopped) in zip(free, capped):
        if stop in full:
            assert stopped and cut == full[: full.index(stop)]
        else:
            assert not stopped and cut == full


def test_sampled_batch_is_seeded(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    lm = tiny_llama
    params = SamplingParams(temperature=1.0, top_p=0.9)
    a = generate_batch(lm.model, [[5, 6], [7]], 15, params, set(), torch.Generator().manual_seed(1))
    b = generate_batch(lm.model, [[5, 6], [7]], 15, params, set(), torch.Generator().manual_seed(1))
    assert a == b and all(len(t) == 15 for t, _ in a)
