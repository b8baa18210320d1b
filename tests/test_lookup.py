"""Prompt lookup: the n-gram index alone, then lookup drafting (alone and before a drafter) against vanilla."""

from __future__ import annotations

import pytest
import torch

from moaspec.decoding import GenerationConfig, SamplingParams, generate
from moaspec.decoding.lookup import LookupProposer, NgramIndex
from moaspec.decoding.proposer import Proposal
from moaspec.decoding.speculative import generate_chain
from moaspec.errors import MoaspecError
from moaspec.strategy import Strategy
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


def test_matching_an_unsettled_tail_does_not_index_it() -> None:
    index = NgramIndex()
    index.update([1, 2, 3, 1])  # settled
    assert index.match([1, 2, 3, 1, 2], 3) == [3, 1, 2]  # the tail "2" is looked up, not recorded
    assert index.match([1, 2, 3, 1, 9], 2) == []  # so a different tail leaves no trace of the first
    assert index.continuation([1, 2, 3, 1, 9], 2) == []
    with pytest.raises(ValueError):
        index.match([1, 2], 2)  # shorter than what is indexed: not its prefix


def test_bad_ngram_bounds_are_refused() -> None:
    with pytest.raises(MoaspecError):
        NgramIndex(max_ngram=2, min_ngram=3)
    with pytest.raises(MoaspecError):
        Strategy(lookup=-1)


class FixedDrafter:
    """A proposer that always drafts the same tokens: shows who drafted a cycle."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, tokens, n, sampling, generator):  # type: ignore[no-untyped-def]
        return Proposal(torch.tensor(self.tokens[:n]), None)


def test_a_one_token_match_copies_alone_but_leaves_the_cycle_to_a_drafter() -> None:
    only_one_token_recurs = [5, 1, 7, 8, 1]  # "1" occurred before (then 7 followed); "8 1" did not
    alone = LookupProposer(50)
    assert alone.propose(only_one_token_recurs, 2, SamplingParams(), None).tokens.tolist() == [7, 8]

    def behind() -> LookupProposer:
        return LookupProposer(50, FixedDrafter([30, 31]), drafter_len=2)  # type: ignore[arg-type]

    assert behind().propose(only_one_token_recurs, 4, SamplingParams(), None).tokens.tolist() == [30, 31]
    two_tokens_recur = [5, 1, 7, 8, 5, 1]  # "5 1" occurred before: that copy goes first
    assert behind().propose(two_tokens_recur, 3, SamplingParams(), None).tokens.tolist() == [7, 8, 5]
    forced = LookupProposer(50, FixedDrafter([30, 31]), drafter_len=2, min_ngram=1)  # type: ignore[arg-type]
    assert forced.propose(only_one_token_recurs, 2, SamplingParams(), None).tokens.tolist() == [7, 8]
    with pytest.raises(MoaspecError):
        Strategy(lookup=4, lookup_min_ngram=0)
    assert Strategy(lookup=4, lookup_min_ngram=1).describe() == "lookup(4,min_ngram=1)"


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


def test_a_tree_needs_a_drafter_for_lookup_to_graft_onto() -> None:
    from moaspec.decoding.tree import TreeShape

    with pytest.raises(MoaspecError, match="tree"):
        Strategy(tree=TreeShape(), lookup=4)


def test_grafting_follows_agreeing_nodes_and_branches_at_the_first_difference() -> None:
    from moaspec.decoding.tree import DraftTree

    # root 9 → 1 → 2, root 9 → 3
    tree = DraftTree(torch.tensor([9, 1, 3, 2]), [-1, 0, 0, 1], torch.tensor([0, 1, 1, 2]))
    grafted = tree.graft([1, 2, 5, 6])
    assert grafted.tokens.tolist() == [9, 1, 3, 2, 5, 6]
    assert grafted.parents == [-1, 0, 0, 1, 3, 4]
    assert grafted.depths.tolist() == [0, 1, 1, 2, 3, 4]
    assert tree.graft([]).parents == tree.parents
    other = tree.graft([4, 1])  # a new first token: a new branch from the root
    assert other.parents[4:] == [0, 4] and other.tokens[4:].tolist() == [4, 1]


class OracleIndex:
    """Lookup that "finds" the target's true greedy continuation, wrong at every ``corrupt_every``-th token."""

    def __init__(self, prompt: list[int], want: list[int], corrupt_every: int) -> None:
        self.prompt, self.want, self.corrupt_every = prompt, want, corrupt_every

    def continuation(self, tokens: list[int], count: int) -> list[int]:
        done = len(tokens) - len(self.prompt)
        out = self.want[done : done + count]
        return [t + 1 if self.corrupt_every and (done + i) % self.corrupt_every == 0 else t for i, t in enumerate(out)]


@pytest.mark.parametrize("corrupt_every", [0, 4])
def test_grafted_lookup_drafts_are_accepted_and_greedy_output_is_unchanged(tiny_llama, corrupt_every: int) -> None:  # type: ignore[no-untyped-def]
    from moaspec.decoding.tree import TreeShape, generate_tree

    model, tok = tiny_llama.model, tiny_llama.tokenizer
    cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    for tli in (0, 1):
        for prompt in PROMPTS:
            want = generate(model, tok, prompt, cfg).token_ids
            proposer = LookupProposer(tiny_llama.cfg.vocab_size, moa_proposer(tiny_llama, tli=tli), tree_lookup=6)
            proposer.index = OracleIndex(prompt, want, corrupt_every)  # type: ignore[assignment]
            got = generate_tree(model, tok, proposer, prompt, cfg, TreeShape(depth=2, top_k=2, total=4))
            assert got.token_ids == want
            assert max(got.accepted_lengths) == 7 if not corrupt_every else max(got.accepted_lengths) > 3


def test_sampled_tree_with_lookup_runs_and_is_reproducible(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    from moaspec.decoding.tree import TreeShape

    cfg = GenerationConfig(max_new_tokens=30, ignore_eos=True, sampling=SamplingParams(temperature=0.8, seed=2))
    strategy = Strategy(moa_proposer(tiny_llama).drafter, tree=TreeShape(depth=2, top_k=2, total=4), lookup=6)
    runs = [strategy.run(tiny_llama, PROMPTS[2], cfg) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 30
