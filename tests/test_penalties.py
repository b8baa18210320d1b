"""OpenAI's presence and frequency penalties under speculation: greedy output equals plain decoding's with them.

(That sampling with them keeps the penalised target's distribution is checked in
``test_sampling_distribution.py``.)
"""

from __future__ import annotations

import pytest
import torch

from moaspec.decoding import GenerationConfig, SamplingParams, generate
from moaspec.decoding.batched import Request
from moaspec.decoding.sampling import path_counts, penalize
from moaspec.decoding.strategy import Strategy
from moaspec.decoding.tree import DraftTree, TreeShape
from moaspec.drafters.independent import IndependentConfig, IndependentDrafter
from moaspec.errors import MoaspecError

PROMPT = [5, 17, 42, 8, 99, 3, 64, 21]
REPEATING = [200, 3, 3, 3, 3, 9, 3, 3, 3]  # a prompt the tiny target continues with repeats: penalties bite
PENALTIES = SamplingParams(presence_penalty=0.7, frequency_penalty=0.9)


def test_penalties_on_hand_made_logits() -> None:
    logits, counts = torch.zeros(4), torch.tensor([0.0, 1.0, 3.0, 0.0])
    assert penalize(logits, counts, PENALTIES).tolist() == pytest.approx([0.0, -1.6, -3.4, 0.0])
    assert penalize(logits, counts, SamplingParams()) is logits  # no penalty, no work


def test_each_row_counts_the_drafts_on_its_own_path() -> None:
    # root 5 (already in the answer's counts); node 1 and 2 below it; node 3 (token 1 again) below node 1
    tree = DraftTree.from_parents([5, 1, 2, 1], [-1, 0, 0, 1])
    before = torch.zeros(8)
    before[5] = 1
    rows = path_counts(before, tree.tokens, tree.ancestors())
    want = torch.zeros(4, 8)
    want[:, 5] = 1
    want[1, 1], want[2, 2], want[3, 1] = 1, 1, 2
    assert torch.equal(rows, want)


def naive_greedy(loaded, prompt: list[int], n: int, params: SamplingParams) -> list[int]:  # type: ignore[no-untyped-def]
    """Greedy decoding with the penalties written out: one whole forward per token."""
    out: list[int] = []
    for _ in range(n):
        seq = prompt + out
        logits = loaded.model(torch.tensor([seq]), loaded.model.new_cache(len(seq))).logits[0, -1].clone()
        for t in set(out):
            logits[t] -= params.presence_penalty + params.frequency_penalty * out.count(t)
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("name", ["chain", "tree", "lookup", "lookup-tree"])
def test_greedy_speculation_with_penalties_equals_plain_decoding(tiny_llama, name: str) -> None:  # type: ignore[no-untyped-def]
    # the target's own blocks as the drafter: it drafts the unpenalised argmax, which the penalties often overrule
    d = IndependentDrafter(IndependentConfig.for_target(tiny_llama.cfg, layers=tiny_llama.cfg.num_layers))
    d.copy_target_layers(tiny_llama.model)
    d.attach(tiny_llama.model)
    d.eval()
    strategy = {"chain": Strategy(d, chain=3), "tree": Strategy(d, tree=TreeShape(depth=3, top_k=2, total=6)),
                "lookup": Strategy(d, chain=2, lookup=4),
                "lookup-tree": Strategy(d, tree=TreeShape(depth=2, top_k=2, total=4), lookup=4)}[name]
    config = GenerationConfig(max_new_tokens=40, sampling=PENALTIES, ignore_eos=True)
    for prompt in (PROMPT, REPEATING):
        plain = generate(tiny_llama.model, tiny_llama.tokenizer, prompt, config)
        assert plain.token_ids == naive_greedy(tiny_llama, prompt, 40, PENALTIES)
        unpenalised = generate(tiny_llama.model, tiny_llama.tokenizer, prompt, GenerationConfig(max_new_tokens=40,
                                                                                                 ignore_eos=True))
        assert unpenalised.token_ids != plain.token_ids  # the penalties changed the answer
        with torch.no_grad():
            result = strategy.run(tiny_llama, prompt, config)
        assert result.token_ids == plain.token_ids
        assert result.target_calls < 30  # drafts were accepted, so rows past the first were penalised by their paths
        assert any(n == 1 for n in result.accepted_lengths)  # and some were refused: the penalties overruled them


def test_bad_penalties_are_refused() -> None:
    for bad in (2.5, -3, float("nan"), "1"):
        with pytest.raises(MoaspecError, match="penalty"):
            SamplingParams(presence_penalty=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="penalties"):
        Request([1, 2], 4, SamplingParams(frequency_penalty=0.5))
