"""Prompt lookup: the n-gram index alone, then lookup drafting (alone and before a drafter) against vanilla."""

from __future__ import annotations

import pytest
import torch

from moaspec.decoding import GenerationConfig, SamplingParams, generate
from moaspec.decoding.lookup import LookupProposer, NgramIndex
from moaspec.decoding.speculative import generate_chain
from moaspec.decoding.strategy import Strategy
from moaspec.errors import MoaspecError
from test_speculative import PROMPTS, moa_proposer


def test_the_longest_suffix_that_occurred_before_wins() -> None:
    # the 1-gram "2" last occurred before 8, but the 2-gram "1 2" occurred before 7
    assert NgramIndex(max_ngram=3).continuation([5, 1, 2, 7, 9, 2, 8, 1, 2], 2) == [7, 9]
    assert NgramIndex(max_ngram=1).continuation([5, 1, 2, 7, 9, 2, 8, 1, 2], 2) == [8, 1]


def test_the_most_recent_occurrence_wins_and_a_loop_is_copied_in_full() -> None:
    assert NgramIndex().continuation([1, 4, 1, 5, 1], 3) == [5, 1, 5]
    assert NgramIndex().continuation([7, 8, 7, 8], 5) == [7, 8, 7, 8, 7]


def test_no_earlier_occurrence_no_draft() -> None:
    assert NgramIndex().continuation([1, 2, 3, 4], 4) == []
    assert NgramIndex(min_ngram=2).continuation([1, 2, 3, 1], 4) == []  # a lone "1" is too short a match
    assert NgramIndex().continuation([1], 4) == []


def test_growing_the_index_matches_building_it_at_once() -> None:
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 6, (80,), generator=g).tolist()
    grown = NgramIndex()
    for end in range(1, len(seq) + 1):
        assert grown.continuation(seq[:end], 4) == NgramIndex().continuation(seq[:end], 4)
    with pytest.raises(ValueError):
        grown.update(seq[:10])


def test_bad_ngram_bounds_are_refused() -> None:
    with pytest.raises(MoaspecError):
        NgramIndex(max_ngram=2, min_ngram=3)
    with pytest.raises(MoaspecError):
        Strategy(lookup=-1)


@pytest.mark.parametrize("with_drafter", [False, True])
@pytest.mark.parametrize("lookup", [1, 5])
def test_greedy_lookup_equals_vanilla(tiny_llama, with_drafter: bool, lookup: int) -> None:  # type: ignore[no-untyped-def]
    model, tok = tiny_llama.model, tiny_llama.tokenizer
    cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    drafted = 0
    for prompt in PROMPTS:
        inner = moa_proposer(tiny_llama) if with_drafter else None
        proposer = LookupProposer(tiny_llama.cfg.vocab_size, inner, drafter_len=2)
        want = generate(model, tok, prompt, cfg)
        got = generate_chain(model, tok, proposer, prompt, cfg, draft_len=max(2, lookup))
        assert got.token_ids == want.token_ids
        assert got.finish_reason == want.finish_reason
        drafted += sum(got.accepted_lengths) - len(got.accepted_lengths)
    assert drafted > 0  # the random tiny model repeats itself: lookup must have found something


def test_strategy_runs_lookup_alone_and_before_a_drafter(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    cfg = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    want = Strategy().run(tiny_llama, PROMPTS[2], cfg)
    drafter = moa_proposer(tiny_llama).drafter
    for strategy, name in ((Strategy(lookup=4), "lookup(4)"), (Strategy(drafter, chain=2, lookup=6), "moa-chain(2)+lookup(6)")):
        assert strategy.describe() == name
        got = strategy.run(tiny_llama, PROMPTS[2], cfg)
        assert got.token_ids == want.token_ids
        assert got.target_calls < len(got.token_ids)


def test_sampled_lookup_runs_and_is_reproducible(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    cfg = GenerationConfig(max_new_tokens=30, ignore_eos=True, sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=5))
    runs = [Strategy(moa_proposer(tiny_llama).drafter, lookup=5).run(tiny_llama, PROMPTS[2], cfg) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 30


def test_lookup_does_not_combine_with_a_tree(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    from moaspec.decoding.tree import TreeShape

    with pytest.raises(MoaspecError, match="tree"):
        Strategy(moa_proposer(tiny_llama).drafter, tree=TreeShape(), lookup=4)
