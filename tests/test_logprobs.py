"""Log-probabilities of generated tokens: the target's own, whichever decoder made the tokens.

Each decoder reports, per kept token, the target's log-softmax at that token's position,
read from the forward that verified it (a tree's accepted path, a chain's prefix, a plain
step). The reference here is one forward over the prompt and the answer together.
"""

from __future__ import annotations

import pytest
import torch

from moaspec.decoding import GenerationConfig, SamplingParams, generate
from moaspec.decoding.generation import TokenSink
from moaspec.decoding.logprobs import TokenBytes
from moaspec.decoding.tree import TreeShape
from moaspec.drafters.moa import MoAConfig, MoADrafter
from moaspec.errors import MoaspecError
from moaspec.strategy import Strategy

PROMPT = [5, 17, 42, 8, 99, 3, 64, 21]


def drafter(loaded) -> MoADrafter:  # type: ignore[no-untyped-def]
    torch.manual_seed(3)
    d = MoADrafter(MoAConfig.for_target(loaded.cfg))
    d.attach(loaded.model)
    return d.eval()


def reference(loaded, prompt: list[int], answer: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The target's log-probabilities ``[len(answer), V]`` at each answer position, from one forward over everything."""
    ids = prompt + answer
    with torch.no_grad():
        logits = loaded.model(torch.tensor([ids]), loaded.model.new_cache(len(ids))).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : len(ids) - 1].float(), dim=-1)


STRATEGIES = {
    "plain": lambda d: Strategy(),
    "chain": lambda d: Strategy(d, chain=3),
    "tree": lambda d: Strategy(d, tree=TreeShape(depth=3, top_k=2, total=6)),
    "lookup": lambda d: Strategy(d, chain=2, lookup=4),
    "lookup-tree": lambda d: Strategy(d, tree=TreeShape(depth=2, top_k=2, total=4), lookup=4),
}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_decoder_reports_the_targets_own_logprobs(tiny_llama, name: str, temperature: float) -> None:  # type: ignore[no-untyped-def]
    strategy = STRATEGIES[name](drafter(tiny_llama))
    config = GenerationConfig(max_new_tokens=24, sampling=SamplingParams(temperature, seed=7), logprobs=3,
                              ignore_eos=True)
    with torch.no_grad():
        result = strategy.run(tiny_llama, PROMPT, config)
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids) == 24
    want = reference(tiny_llama, PROMPT, result.token_ids)
    for i, entry in enumerate(result.logprobs):
        assert entry.token == result.token_ids[i]
        assert entry.logprob == pytest.approx(float(want[i, entry.token]), abs=1e-4)
        values, ids = want[i].topk(3)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
        if temperature == 0:  # greedy tokens are the target's most likely ones
            assert entry.top[0] == (entry.token, pytest.approx(entry.logprob))
    if name != "plain" and temperature == 0:
        assert result.target_calls < 23  # drafts were accepted: the entries came from multi-token verifications
        plain = generate(tiny_llama.model, tiny_llama.tokenizer, PROMPT, config)
        assert plain.token_ids == result.token_ids


def test_no_logprobs_unless_asked_and_none_past_the_end(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    d = drafter(tiny_llama)
    assert Strategy(d, chain=3).run(tiny_llama, PROMPT, GenerationConfig(max_new_tokens=8)).logprobs is None
    # a stop string ends generation inside a verified chain: one entry per kept token, none for the rest
    full = Strategy().run(tiny_llama, PROMPT, GenerationConfig(max_new_tokens=24, ignore_eos=True))
    stop = tiny_llama.tokenizer.decode(full.token_ids[5:7])
    result = Strategy(d, chain=3).run(tiny_llama, PROMPT, GenerationConfig(max_new_tokens=24, ignore_eos=True,
                                                                           stop=(stop,), logprobs=0))
    assert result.finish_reason == "stop" and result.logprobs is not None
    assert [e.token for e in result.logprobs] == result.token_ids and all(e.top == () for e in result.logprobs)


def test_entries_reach_the_listener_before_the_text_they_belong_to(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    events: list[tuple[str, object]] = []
    config = GenerationConfig(max_new_tokens=16, logprobs=1, ignore_eos=True)
    result = Strategy(drafter(tiny_llama), chain=3).run(
        tiny_llama, PROMPT, config, on_text=lambda t: events.append(("text", t)),
        on_logprobs=lambda e: events.append(("logprobs", list(e))))
    told = [e for kind, entries in events if kind == "logprobs" for e in entries]  # type: ignore[union-attr]
    assert told == result.logprobs[: len(told)]  # type: ignore[index]
    assert all(kind == "logprobs" for kind, _ in events[::2]) and all(kind == "text" for kind, _ in events[1::2])
    assert "".join(t for kind, t in events if kind == "text") == result.text  # type: ignore[misc]


def test_bad_settings_and_decoders_without_logits_are_refused(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(MoaspecError, match="logprobs"):
            GenerationConfig(logprobs=bad)  # type: ignore[arg-type]
    sink = TokenSink(tiny_llama.tokenizer, GenerationConfig(logprobs=0), set(), 8, None)
    with pytest.raises(ValueError, match="logits"):
        sink.push([1, 2])


def test_token_bytes_rebuild_text_that_splits_characters(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    tok = tiny_llama.tokenizer
    text = "héllo wörld — 東京 🙂 naïve"
    ids = tok.encode(text, add_special_tokens=False)
    token_bytes = TokenBytes(tok)
    assert b"".join(token_bytes(i) for i in ids) == text.encode()
    names = [token_bytes.text(i) for i in ids]
    assert any(n.startswith("bytes:\\x") for n in names)  # this tokenizer splits some of these characters
    assert all(n.startswith("bytes:") or n.encode() == token_bytes(i) for n, i in zip(names, ids))


@pytest.mark.parametrize("name", ["plain", "chain", "tree"])
def test_prompt_logprobs_from_the_prefill_are_the_targets_own(tiny_llama, name: str) -> None:  # type: ignore[no-untyped-def]
    from moaspec.decoding.prefill import Prefill, PromptCache

    prompt = PROMPT * 5  # 40 tokens: some positions come from a prompt cache on the second run
    logits = tiny_llama.model(torch.tensor([prompt]), tiny_llama.model.new_cache(len(prompt))).logits[0]
    want = torch.log_softmax(logits[:-1].float(), dim=-1)
    reuse = PromptCache(1 << 30, min_tokens=8)
    strategy = STRATEGIES[name](drafter(tiny_llama))
    config = GenerationConfig(max_new_tokens=4, prompt_logprobs=2)
    for run in range(2):  # read whole, then mostly from the cache (the final states the cache kept)
        with torch.no_grad():
            result = strategy.run(tiny_llama, prompt, config, prefill=Prefill(reuse=reuse))
        assert (result.reused_prompt_tokens > 0) == (run == 1)
        entries = result.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None and result.logprobs is None
        for i, e in enumerate(entries[1:]):
            assert e is not None and e.token == prompt[i + 1]
            assert e.logprob == pytest.approx(float(want[i, e.token]), abs=1e-4)
            assert [t for t, _ in e.top] == want[i].topk(2).indices.tolist()
