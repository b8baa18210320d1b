"""OpenAI's presence and frequency penalties and logit bias under speculation: greedy output equals plain decoding's.

(That sampling with them keeps the penalised target's distribution is checked in
``test_sampling_distribution.py``.)
"""

from __future__ import annotations

import pytest
import torch

from moaspec.decoding import GenerationConfig, SamplingParams, generate
from moaspec.decoding.batched import Request
from moaspec.decoding.sampling import adjust, path_counts
from moaspec.decoding.tree import DraftTree, TreeShape
from moaspec.drafters.independent import IndependentConfig, IndependentDrafter
from moaspec.errors import MoaspecError
from moaspec.strategy import Strategy

PROMPT = [5, 17, 42, 8, 99, 3, 64, 21]
REPEATING = [200, 3, 3, 3, 3, 9, 3, 3, 3]  # a prompt the tiny target continues with repeats: penalties bite
PENALTIES = SamplingParams(presence_penalty=0.7, frequency_penalty=0.9)


def test_penalties_on_hand_made_logits() -> None:
    logits, counts = torch.zeros(4), torch.tensor([0.0, 1.0, 3.0, 0.0])
    assert adjust(logits, PENALTIES, counts).tolist() == pytest.approx([0.0, -1.6, -3.4, 0.0])
    assert adjust(logits, PENALTIES).tolist() == [0.0] * 4  # an empty answer holds nothing to penalise
    assert adjust(logits, SamplingParams()) is logits  # no penalty, no work
    bias = SamplingParams(presence_penalty=0.7, logit_bias=((3, 5.0), (1, -100.0)))
    assert adjust(logits, bias, counts).tolist() == pytest.approx([0.0, -100.7, -0.7, 5.0])


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
    """Greedy decoding with the penalties and the logit bias written out: one whole forward per token."""
    out: list[int] = []
    for _ in range(n):
        seq = prompt + out
        logits = loaded.model(torch.tensor([seq]), loaded.model.new_cache(len(seq))).logits[0, -1].clone()
        for t in set(out):
            logits[t] -= params.presence_penalty + params.frequency_penalty * out.count(t)
        for t, bias in params.logit_bias:
            logits[t] += bias
        out.append(int(logits.argmax()))
    return out


def banning_the_commonest(loaded, prompt: list[int]) -> SamplingParams:  # type: ignore[no-untyped-def]
    """A logit bias that bans the two tokens the plain answer repeats most, and favours a third a little."""
    answer = generate(loaded.model, loaded.tokenizer, prompt, GenerationConfig(max_new_tokens=40, ignore_eos=True))
    common = sorted(set(answer.token_ids), key=answer.token_ids.count)[-3:]
    return SamplingParams(logit_bias=((common[2], -100.0), (common[1], -100.0), (common[0], 1.5)))


@pytest.mark.parametrize("adjustment", ["penalties", "bias"])
@pytest.mark.parametrize("name", ["chain", "tree", "lookup", "lookup-tree"])
def test_greedy_speculation_with_penalties_or_a_bias_equals_plain_decoding(tiny_llama, name: str,  # type: ignore[no-untyped-def]
                                                                            adjustment: str) -> None:
    # the target's own blocks as the drafter: it drafts the plain argmax, which the adjustments often overrule
    d = IndependentDrafter(IndependentConfig.for_target(tiny_llama.cfg, layers=tiny_llama.cfg.num_layers))
    d.copy_target_layers(tiny_llama.model)
    d.attach(tiny_llama.model)
    d.eval()
    strategy = {"chain": Strategy(d, chain=3), "tree": Strategy(d, tree=TreeShape(depth=3, top_k=2, total=6)),
                "lookup": Strategy(d, chain=2, lookup=4),
                "lookup-tree": Strategy(d, tree=TreeShape(depth=2, top_k=2, total=4), lookup=4)}[name]
    for prompt in (PROMPT, REPEATING):
        params = PENALTIES if adjustment == "penalties" else banning_the_commonest(tiny_llama, prompt)
        config = GenerationConfig(max_new_tokens=40, sampling=params, ignore_eos=True)
        plain = generate(tiny_llama.model, tiny_llama.tokenizer, prompt, config)
        assert plain.token_ids == naive_greedy(tiny_llama, prompt, 40, params)
        unadjusted = generate(tiny_llama.model, tiny_llama.tokenizer, prompt, GenerationConfig(max_new_tokens=40,
                                                                                                ignore_eos=True))
        assert unadjusted.token_ids != plain.token_ids  # the adjustment changed the answer
        with torch.no_grad():
            result = strategy.run(tiny_llama, prompt, config)
        assert result.token_ids == plain.token_ids
        assert result.target_calls < 30  # drafts were accepted, so rows past the first were adjusted by their paths
        if adjustment == "penalties":  # and some were refused: the penalties overruled them
            assert any(n == 1 for n in result.accepted_lengths)
        banned = {t for t, b in params.logit_bias if b == -100}
        assert not banned & set(result.token_ids)


def test_bad_penalties_are_refused() -> None:
    for bad in (2.5, -3, float("nan"), "1"):
        with pytest.raises(MoaspecError, match="penalty"):
            SamplingParams(presence_penalty=bad)  # type: ignore[arg-type]
    for bias in (((1, 101.0),), ((-1, 1.0),), ((1, 1.0, 2.0),), tuple((i, 1.0) for i in range(1025))):
        with pytest.raises(MoaspecError, match="logit_bias"):
            SamplingParams(logit_bias=bias)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="penalties"):
        Request([1, 2], 4, SamplingParams(frequency_penalty=0.5))


def test_a_bias_for_a_token_the_target_lacks_is_refused(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    config = GenerationConfig(max_new_tokens=4, sampling=SamplingParams(logit_bias=((10**6, 1.0),)))
    for strategy in (Strategy(), Strategy(chain=2, lookup=3)):
        with pytest.raises(MoaspecError, match="outside the vocabulary"):
            strategy.run(tiny_llama, PROMPT, config)
