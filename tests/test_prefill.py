"""Reading prompts, and reusing the K/V of prompts read before (a conversation's next turn)."""

from __future__ import annotations

import pytest
import torch

from moaspec.decoding import GenerationConfig, generate
from moaspec.decoding.prefill import Prefill, PromptCache
from moaspec.decoding.tree import TreeShape
from moaspec.drafters.moa import MoAConfig, MoADrafter
from moaspec.errors import MoaspecError
from moaspec.models import transformer
from moaspec.strategy import Strategy


@pytest.fixture()
def counted(tiny_llama, monkeypatch):  # type: ignore[no-untyped-def]
    """``tiny_llama`` in prefill chunks of 8, with the number of new tokens each block pass ran."""
    monkeypatch.setitem(transformer.PREFILL_CHUNKS, "cpu", 8)
    model = tiny_llama.model
    passes: list[int] = []
    monkeypatch.setattr(model, "run_blocks", lambda h, *a, _run=model.run_blocks, **k: passes.append(h.shape[1]) or _run(h, *a, **k))
    return model, passes


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def read(model, prompt: list[int], reuse: PromptCache, on_chunk=None):  # type: ignore[no-untyped-def]
    """Read ``prompt`` into a new cache, then keep it, as a generation does at its end: (logits, hidden, reused,
    cache)."""
    prefill, cache = Prefill(on_chunk, reuse), model.new_cache(64)
    logits, hidden, reused = prefill(model, prompt, cache)
    prefill.keep(prompt, cache, [hidden])
    return logits, hidden, reused, cache


def test_a_prompt_that_extends_a_stored_one_reads_only_the_rest(counted) -> None:  # type: ignore[no-untyped-def]
    model, passes = counted
    turn1, more = ids(40, 1), ids(13, 2)
    reuse = PromptCache(1 << 30, min_tokens=16)
    read(model, turn1, reuse)
    passes.clear()
    told: list[tuple[int, int]] = []
    logits, hidden, reused, cache = read(model, turn1 + more, reuse, lambda d, t: told.append((d, t)))
    assert reused == 40 and sum(passes) == 13 and told == [(48, 53), (53, 53)]  # progress counts the reused part
    fresh = model.new_cache(64)
    want_logits, want_hidden, none = Prefill()(model, turn1 + more, fresh)
    assert none == 0 and cache.length == fresh.length == 53
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(hidden, want_hidden, atol=1e-4, rtol=0)
    torch.testing.assert_close(cache.keys[..., :53, :], fresh.keys[..., :53, :], atol=1e-4, rtol=0)
    assert len(reuse) == 1  # the longer prompt replaced the one it extends


def test_what_is_reused_and_kept(counted) -> None:  # type: ignore[no-untyped-def]
    model, passes = counted
    a, b = ids(40, 3), ids(40, 4)
    per_token = 2 * model.cfg.num_layers * model.cfg.num_kv_heads * model.cfg.head_dim * 4 + model.cfg.hidden_size * 4
    reuse = PromptCache(per_token * 60, min_tokens=16)
    read(model, ids(10, 5), reuse)
    assert len(reuse) == 0  # shorter than min_tokens: not worth keeping
    read(model, a, reuse)
    passes.clear()
    assert read(model, a, reuse)[2] == 39 and passes == [1]  # the last token is read again
    assert read(model, a[:20] + b[:20], reuse)[2] == 20  # a shared beginning is enough
    assert read(model, a[:10] + b[:30], reuse)[2] == 0  # under min_tokens in common
    assert len(reuse) == 1 and reuse.nbytes <= per_token * 60  # 3 prompts of 40 tokens in room for 60: the newest stays
    assert read(model, a, reuse)[2] == 0


def test_what_readers_derive_per_position_is_kept_beside_the_kv(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """Extras (a MoA server's memory entries) come back for the longest stored beginning of a prompt, as far as
    their rows go, and survive a longer prompt that replaces theirs without them."""
    model = tiny_llama.model
    reuse = PromptCache(1 << 30, min_tokens=8)
    a, more = ids(20, 8), ids(10, 9)
    cache = model.new_cache(64)
    _, hidden, _ = Prefill()(model, a + more, cache)
    rows = torch.arange(30.0)[:, None].repeat(1, 3)
    assert reuse.extra("memory", a) is None
    reuse.store(a, cache, hidden, {"memory": rows[:15]})  # rows for the first 15 of its 20 positions
    assert torch.equal(reuse.extra("memory", a + more), rows[:15])
    assert torch.equal(reuse.extra("memory", a[:12] + more), rows[:12])
    assert reuse.extra("memory", more) is None and reuse.extra("other", a) is None
    reuse.store(a + more, cache, hidden)  # replaces the shorter prompt, and inherits what only it had
    assert len(reuse) == 1 and torch.equal(reuse.extra("memory", a + more), rows[:15])
    reuse.store(a + more, cache, hidden, {"memory": rows * 2})  # its own rows win over inherited ones
    assert len(reuse) == 1 and torch.equal(reuse.extra("memory", a + more), rows * 2)


def test_an_abandoned_read_leaves_an_empty_cache(counted) -> None:  # type: ignore[no-untyped-def]
    model, _ = counted
    reuse = PromptCache(1 << 30, min_tokens=16)
    first = ids(40, 6)
    read(model, first, reuse)

    class Gone(Exception):
        pass

    def give_up(done: int, total: int) -> None:
        raise Gone

    cache = model.new_cache(64)
    with pytest.raises(Gone):
        Prefill(give_up, reuse)(model, first + ids(20, 7), cache)
    assert cache.length == 0 and len(reuse) == 1


def test_next_turns_decode_as_without_reuse(tiny_llama, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A conversation whose turns reuse the previous turns (prompts and answers) decodes the target's own greedy
    tokens, plain and with MoA drafters' chains and trees (one with Target Layer Inference and the newest memory
    entry in Cross-Attention's input); the drafter begins from what it kept of them (LSA
    runs on the new positions only, SA catches up on the new tokens only) and drafts as it would afresh."""
    torch.manual_seed(3)
    drafter = MoADrafter(MoAConfig.for_target(tiny_llama.cfg)).eval()
    drafter.attach(tiny_llama.model)
    tli = MoADrafter(MoAConfig.for_target(tiny_llama.cfg, tli_layers=1, newest_entry=True)).eval()
    torch.nn.init.normal_(tli.newest_proj.weight, std=0.05)
    tli.attach(tiny_llama.model)
    lsa: list[tuple[int, int]] = []
    for d in (drafter, tli):
        monkeypatch.setattr(d, "memory_entries", lambda cache, start, end, hidden, _run=d.memory_entries:
                            lsa.append((start, end)) or _run(cache, start, end, hidden))
    cfg = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    for strategy in (Strategy(), Strategy(drafter, chain=3), Strategy(drafter, tree=TreeShape(), lookup=4),
                     Strategy(tli, chain=3)):
        reuse = PromptCache(1 << 30, min_tokens=16)
        conversation, step = ids(30, 8), 0  # step: the most tokens one verification of the last turn took in
        for turn in range(3):
            lsa.clear()
            got = strategy.run(tiny_llama, conversation, cfg, prefill=Prefill(reuse=reuse))
            reused_lsa, lsa[:] = list(lsa), []
            afresh = strategy.run(tiny_llama, conversation, cfg)
            want = generate(tiny_llama.model, tiny_llama.tokenizer, conversation, cfg)
            assert got.token_ids == afresh.token_ids == want.token_ids
            assert got.accepted_lengths == afresh.accepted_lengths  # the same drafts, accepted alike
            # from the second turn on, everything but the new message (10 tokens) is reused: the previous prompt
            # and answer, but perhaps the answer's last token (only a verification past it writes its K/V)
            assert got.reused_prompt_tokens in ((0,) if turn == 0 else (len(conversation) - 11, len(conversation) - 10))
            if strategy.drafter is not None:  # the drafter's kept state ends where it last took in a verification
                start, end = reused_lsa[0]
                assert end == len(conversation) and (start == 0 if turn == 0 else got.reused_prompt_tokens - step <= start)
                assert start <= got.reused_prompt_tokens
            conversation, step = conversation + got.token_ids + ids(10, 9 + turn), max(got.accepted_lengths)


@pytest.mark.parametrize("tree", [False, True])
def test_an_answer_done_at_its_first_token_is_kept_without_the_drafters_state(tiny_llama, tree: bool) -> None:  # type: ignore[no-untyped-def]
    """With a prompt cache, an answer that ends at its first token (one token asked for; /v1/completions scores a
    prompt with max_tokens 0 and echo so) never started the drafter: the target's K/V are kept alone
    (this raised an AssertionError, a server's 500), and the next turn reads them and drafts from scratch."""
    torch.manual_seed(3)
    drafter = MoADrafter(MoAConfig.for_target(tiny_llama.cfg)).eval()
    drafter.attach(tiny_llama.model)
    strategy = Strategy(drafter, tree=TreeShape()) if tree else Strategy(drafter, chain=3)
    reuse, prompt = PromptCache(1 << 30, min_tokens=16), ids(30, 8)
    first = strategy.run(tiny_llama, prompt, GenerationConfig(max_new_tokens=1), prefill=Prefill(reuse=reuse))
    assert first.token_ids == generate(tiny_llama.model, tiny_llama.tokenizer, prompt,
                                       GenerationConfig(max_new_tokens=1)).token_ids
    longer, cfg = prompt + ids(10, 9), GenerationConfig(max_new_tokens=8, ignore_eos=True)
    got = strategy.run(tiny_llama, longer, cfg, prefill=Prefill(reuse=reuse))
    assert got.reused_prompt_tokens >= len(prompt) - 1
    assert got.token_ids == generate(tiny_llama.model, tiny_llama.tokenizer, longer, cfg).token_ids


@pytest.mark.parametrize("max_bytes, min_tokens", [(-1, 256), (1.5, 256), ("512", 256), (1 << 20, 0)])
def test_a_prompt_cache_of_a_bad_size_is_refused_in_one_sentence(max_bytes, min_tokens) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MoaspecError, match="a prompt cache needs whole numbers"):
        PromptCache(max_bytes, min_tokens=min_tokens)


def test_a_prefill_reads_each_chunk_with_the_threads_it_is_given_then_restores_its_own(counted, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model, _ = counted
    seen: list[int] = []
    monkeypatch.setattr(model, "run_blocks", lambda h, *a, _run=model.run_blocks, **k: seen.append(torch.get_num_threads())
                        or _run(h, *a, **k))
    answers = iter([2, 1, 2, 2])  # asked before the first chunk and after each but the last: 4 chunks of 8

    def gone(done: int, total: int) -> None:
        raise RuntimeError("the client left")

    own = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Prefill(threads=lambda: next(answers))(model, ids(30, 11), model.new_cache(64))
        assert seen == [2, 1, 2, 2] and torch.get_num_threads() == 1
        seen.clear()
        with pytest.raises(RuntimeError):  # abandoned after its first chunk: the thread's own count is back all the same
            Prefill(on_chunk=gone, threads=lambda: 2)(model, ids(30, 11), model.new_cache(64))
        assert seen == [2] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(own)


def test_the_drafters_first_pass_over_the_prompt_runs_on_the_prefills_threads(tiny_llama, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(3)
    drafter = MoADrafter(MoAConfig.for_target(tiny_llama.cfg)).eval()
    drafter.attach(tiny_llama.model)
    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(drafter, "memory_entries", lambda cache, start, end, hidden, _run=drafter.memory_entries:
                        seen.append((end - start, torch.get_num_threads())) or _run(cache, start, end, hidden))
    own = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Strategy(drafter, chain=2).run(tiny_llama, ids(30, 12), GenerationConfig(max_new_tokens=6, ignore_eos=True),
                                       prefill=Prefill(threads=lambda: 2))
        assert seen[0] == (30, 2) and all(t == 1 for _, t in seen[1:]) and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(own)
