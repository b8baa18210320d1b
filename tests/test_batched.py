"""Batched generation (for distillation data) equals one-by-one generation, however rows are batched."""

from __future__ import annotations

import pytest
import torch

from moaspec.decoding import GenerationConfig, generate
from moaspec.decoding.batched import Request, generate_many
from moaspec.decoding.opening import stop_token_ids
from moaspec.decoding.sampling import SamplingParams
from moaspec.models import transformer


def _prompts(lm, lengths):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, lm.cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("batch_size", [8, 2, 1])
def test_greedy_batch_equals_single_generation(tiny_llama, batch_size) -> None:  # type: ignore[no-untyped-def]
    """All requests at once, two at a time (each ended one replaced at once) and one at a time all give vanilla
    greedy."""
    lm = tiny_llama
    prompts = _prompts(lm, (5, 17, 9, 1, 12))
    budgets = (30, 7, 22, 30, 15)
    eos = stop_token_ids(lm.model, lm.tokenizer)
    requests = [Request(p, n) for p, n in zip(prompts, budgets)]
    batch = generate_many(lm.model, requests, eos, batch_size=batch_size)
    for p, n, (toks, stopped) in zip(prompts, budgets, batch):
        single = generate(lm.model, lm.tokenizer, p, GenerationConfig(max_new_tokens=n))
        assert toks == single.token_ids
        assert stopped == (single.finish_reason == "eos")


def test_long_prompts_prefilled_in_chunks_into_their_rows(tiny_llama, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each prompt is prefilled alone into its own cache, in chunks (4 tokens here) when it is long: the rows
    still decode as one-by-one generation does."""
    monkeypatch.setitem(transformer.PREFILL_CHUNKS, "cpu", 4)
    lm = tiny_llama
    prompts = _prompts(lm, (13, 3, 22))
    batch = generate_many(lm.model, [Request(p, 12) for p in prompts], set(), batch_size=3)
    for p, (toks, _) in zip(prompts, batch):
        assert toks == generate(lm.model, lm.tokenizer, p, GenerationConfig(max_new_tokens=12, ignore_eos=True)).token_ids


def test_rows_finish_independently(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """A stop id that some rows hit early: they leave the batch, the others go on unchanged."""
    lm = tiny_llama
    requests = [Request(p, 12) for p in ([5, 6, 7], [8, 9], [10, 11, 12, 13])]
    free = generate_many(lm.model, requests, set())
    stop = free[1][0][2]  # row 1's third token becomes a stop id
    capped = generate_many(lm.model, requests, {stop})
    for (full, _), (cut, stopped) in zip(free, capped):
        if stop in full:
            assert stopped and cut == full[: full.index(stop)]
        else:
            assert not stopped and cut == full


def test_sampled_batch_is_seeded_and_mixes_with_greedy(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """Sampled rows are reproducible from the seed; greedy rows in the same batch stay greedy."""
    lm = tiny_llama
    hot = SamplingParams(temperature=1.0, top_p=0.9)
    requests = [Request([5, 6], 15, hot), Request([7], 15), Request([9, 4, 2], 15, hot)]
    a = generate_many(lm.model, requests, set(), torch.Generator().manual_seed(1), batch_size=2)
    b = generate_many(lm.model, requests, set(), torch.Generator().manual_seed(1), batch_size=2)
    assert a == b and all(len(t) == 15 for t, _ in a)
    assert a[1][0] == generate(lm.model, lm.tokenizer, [7], GenerationConfig(max_new_tokens=15)).token_ids


def test_empty_prompt_and_empty_batch_are_refused(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="non-empty prompt"):
        generate_many(tiny_llama.model, [Request([], 4)], set())
    with pytest.raises(ValueError, match="batch_size"):
        generate_many(tiny_llama.model, [Request([1], 4)], set(), batch_size=0)
