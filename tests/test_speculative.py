"""Chain speculative decoding: greedy output identical to vanilla, sampling keeps the target's distribution."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from moaspec.decoding import GenerationConfig, SamplingParams, generate
from moaspec.decoding.proposer import Proposal
from moaspec.decoding.sampling import probabilities, sample
from moaspec.decoding.speculative import generate_chain
from moaspec.decoding.verify import verify_greedy, verify_sampling
from moaspec.drafters import moa
from moaspec.drafters.eagle import EagleConfig, EagleDrafter
from moaspec.drafters.independent import IndependentConfig, IndependentDrafter
from moaspec.drafters.moa import MoAConfig, MoADrafter
from moaspec.drafters.proposers import EagleProposer, IndependentProposer, MoAProposer
from moaspec.models import transformer
from moaspec.models.block_kernel import kernel
from moaspec.models.kv_cache import KVCache


class OracleProposer:
    """Drafts with the target itself (its own cache): every greedy draft is right."""

    def __init__(self, model, corrupt_every: int = 0) -> None:  # type: ignore[no-untyped-def]
        self.model, self.corrupt_every, self.count = model, corrupt_every, 0

    def begin(self, target_cache: KVCache, hidden: torch.Tensor) -> None:
        self.cache = self.model.new_cache(target_cache.capacity + 8)

    def propose(self, tokens: Sequence[int], n: int, sampling: SamplingParams, generator) -> Proposal:  # type: ignore[no-untyped-def]
        self.cache.reset()
        seq = list(tokens)
        out = []
        for _ in range(n):
            logits = self.model(torch.tensor([seq]), self.model.new_cache(len(seq))).logits[0, -1]
            tok = int(logits.argmax())
            self.count += 1
            if self.corrupt_every and self.count % self.corrupt_every == 0:
                tok = (tok + 1) % logits.shape[-1]
            out.append(tok)
            seq.append(tok)
        return Proposal(torch.tensor(out, dtype=torch.long), None)

    def commit(self, verified: int, path=None, hidden=None) -> None:  # type: ignore[no-untyped-def]
        pass


def moa_proposer(loaded, tli: int = 0, vocab: int = 0, memory: str = "lsa", newest: bool = False,  # type: ignore[no-untyped-def]
                 dtype: torch.dtype = torch.float32, derotate: bool = False, int8: bool = False) -> MoAProposer:
    torch.manual_seed(3)
    d = MoADrafter(MoAConfig.for_target(loaded.cfg, tli_layers=tli, draft_vocab_size=vocab, memory_source=memory,
                                        newest_entry=newest, derotate_keys=derotate)).to(dtype)
    for proj in (d.final_proj, d.newest_proj):  # they start at zero, which would leave their inputs unread
        if proj is not None:
            torch.nn.init.normal_(proj.weight, std=0.05)
    if vocab:
        d.set_draft_vocab(torch.arange(vocab))
    d.attach(loaded.model)
    return MoAProposer(d.eval().use_int8(int8))


def eagle_proposer(loaded, vocab: int = 0, dtype: torch.dtype = torch.float32,  # type: ignore[no-untyped-def]
                   int8: bool = False) -> EagleProposer:
    torch.manual_seed(4)
    d = EagleDrafter(EagleConfig.for_target(loaded.cfg, draft_vocab_size=vocab)).to(dtype)
    if vocab:
        d.set_draft_vocab(torch.arange(vocab))
    d.attach(loaded.model)
    return EagleProposer(d.eval().use_int8(int8))


def independent_proposer(loaded, vocab: int = 0, layers: int = 1,  # type: ignore[no-untyped-def]
                          dtype: torch.dtype = torch.float32, int8: bool = False) -> IndependentProposer:
    """A drafter made of the target's first ``layers`` blocks; all of them makes it the target itself."""
    d = IndependentDrafter(IndependentConfig.for_target(loaded.cfg, draft_vocab_size=vocab, layers=layers))
    if vocab:
        d.set_draft_vocab(torch.arange(vocab))
    d.copy_target_layers(loaded.model)
    d = d.to(dtype)
    d.attach(loaded.model)
    return IndependentProposer(d.eval().use_int8(int8))


PROMPTS = [[5, 17, 42, 7], list(range(30, 60)), [200, 3, 3, 3, 3, 9]]


@pytest.mark.parametrize("kind", ["oracle", "oracle-corrupt", "moa", "moa-tli1", "moa-vocab", "moa-no-lsa", "moa-final", "moa-newest",
                                  "moa-derot", "eagle",
                                  "independent", "independent-whole",
                                  # drafting in bf16 beside the fp32 target (drafting_precision on CPUs with bf16 kernels)
                                  "moa-bf16", "moa-tli1-bf16", "moa-derot-bf16", "eagle-bf16", "independent-bf16",
                                  # int8 weights in the drafter's products (--drafter-dtype int8)
                                  "moa-int8", "moa-tli1-int8", "eagle-int8", "independent-int8",
                                  # fp32 drafters on 8-bit blocks with compiled layers (the default on CPUs without bf16)
                                  "moa-q8", "moa-tli1-q8", "moa-newest-q8", "eagle-q8", "independent-q8"])
@pytest.mark.parametrize("draft_len", [1, 4, 7])
def test_greedy_chain_equals_vanilla(tiny_llama, kind: str, draft_len: int) -> None:  # type: ignore[no-untyped-def]
    if kind.endswith("-q8") and kernel() is None:
        pytest.skip("the compiled block kernel does not build or run here")
    model, tok = tiny_llama.model, tiny_llama.tokenizer
    cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        proposer = {
            "oracle": lambda: OracleProposer(model), "oracle-corrupt": lambda: OracleProposer(model, corrupt_every=3),
            "moa": lambda: moa_proposer(tiny_llama), "moa-tli1": lambda: moa_proposer(tiny_llama, tli=1),
            "moa-vocab": lambda: moa_proposer(tiny_llama, vocab=100), "eagle": lambda: eagle_proposer(tiny_llama, vocab=100),
            "independent": lambda: independent_proposer(tiny_llama, vocab=100),
            "independent-whole": lambda: independent_proposer(tiny_llama, layers=tiny_llama.cfg.num_layers),
            "moa-no-lsa": lambda: moa_proposer(tiny_llama, memory="last-layer"),
            "moa-final": lambda: moa_proposer(tiny_llama, memory="lsa+final"),
            "moa-newest": lambda: moa_proposer(tiny_llama, newest=True),
            "moa-derot": lambda: moa_proposer(tiny_llama, derotate=True),
            "moa-derot-bf16": lambda: moa_proposer(tiny_llama, derotate=True, dtype=torch.bfloat16),
            "moa-bf16": lambda: moa_proposer(tiny_llama, vocab=100, dtype=torch.bfloat16),
            "moa-tli1-bf16": lambda: moa_proposer(tiny_llama, tli=1, dtype=torch.bfloat16),
            "eagle-bf16": lambda: eagle_proposer(tiny_llama, vocab=100, dtype=torch.bfloat16),
            "independent-bf16": lambda: independent_proposer(tiny_llama, vocab=100, dtype=torch.bfloat16),
            "moa-int8": lambda: moa_proposer(tiny_llama, vocab=100, dtype=torch.bfloat16, int8=True),
            "moa-tli1-int8": lambda: moa_proposer(tiny_llama, tli=1, dtype=torch.bfloat16, int8=True),
            "eagle-int8": lambda: eagle_proposer(tiny_llama, vocab=100, dtype=torch.bfloat16, int8=True),
            "independent-int8": lambda: independent_proposer(tiny_llama, vocab=100, dtype=torch.bfloat16, int8=True),
            "moa-q8": lambda: moa_proposer(tiny_llama, vocab=100, int8=True),
            "moa-tli1-q8": lambda: moa_proposer(tiny_llama, tli=1, int8=True),
            "moa-newest-q8": lambda: moa_proposer(tiny_llama, newest=True, int8=True),
            "eagle-q8": lambda: eagle_proposer(tiny_llama, vocab=100, int8=True),
            "independent-q8": lambda: independent_proposer(tiny_llama, vocab=100, int8=True),
        }[kind]()
        want = generate(model, tok, prompt, cfg)
        got = generate_chain(model, tok, proposer, prompt, cfg, draft_len=draft_len)
        assert got.token_ids == want.token_ids
        assert got.finish_reason == want.finish_reason
        assert sum(got.accepted_lengths) >= len(got.token_ids) - 1
        if kind in ("oracle", "independent-whole"):  # every draft is the target's own token
            assert got.tau > min(draft_len, 3)  # all drafts accepted except at the budget's end


@pytest.mark.parametrize("kind", ["moa", "moa-tli1", "moa-final", "eagle", "independent"])
def test_long_prompts_run_in_chunks_and_draft_as_in_one_pass(tiny_llama, kind: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The target's prefill, the memory entries and the drafter's catch-up on a prompt run in chunks (5, 3
    and 5 tokens here; 256, 128 and 256 on a CPU): the drafter drafts what it drafts in one pass, and greedy
    decoding stays the target's."""
    model, tok = tiny_llama.model, tiny_llama.tokenizer
    make = {"moa": lambda: moa_proposer(tiny_llama), "moa-tli1": lambda: moa_proposer(tiny_llama, tli=1),
            "moa-final": lambda: moa_proposer(tiny_llama, memory="lsa+final"),
            "eagle": lambda: eagle_proposer(tiny_llama), "independent": lambda: independent_proposer(tiny_llama)}[kind]
    prompt = torch.randint(0, tiny_llama.cfg.vocab_size, (41,), generator=torch.Generator().manual_seed(5)).tolist()

    def drafts() -> tuple[list[int], list[torch.Tensor]]:
        """The drafts after the prompt, and the drafter's caches of the prompt (SA's and the memory's; its own)."""
        cache = model.new_cache(64)
        out = model(torch.tensor([prompt[:-1]]), cache)
        proposer = make()
        proposer.begin(cache, out.hidden[0])
        tokens = proposer.propose(prompt, 4, SamplingParams(), None).tokens.tolist()
        own = [proposer.state.sa, proposer.state.memory] if kind.startswith("moa") else [proposer.own]
        return tokens, [c.keys[..., :40, :].clone() for c in own] + [cache.keys[..., :40, :].clone()]

    whole, whole_caches = drafts()
    monkeypatch.setitem(transformer.PREFILL_CHUNKS, "cpu", 5)
    monkeypatch.setattr(moa, "LSA_CHUNK", 3)
    chunked, chunked_caches = drafts()
    assert chunked == whole
    for a, b in zip(chunked_caches, whole_caches, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    cfg = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    assert generate_chain(model, tok, make(), prompt, cfg, draft_len=3).token_ids == generate(model, tok, prompt, cfg).token_ids


def test_a_chain_ends_at_the_first_later_draft_below_the_confidence(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """The rule itself: the drafts are a prefix of the full chain, cut before the first draft after
    the first whose drafter probability is below the threshold; and decoding stays lossless."""
    model, tok = tiny_llama.model, tiny_llama.tokenizer

    class Recorded(MoAProposer):
        def _feed(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            logits, feat = super()._feed(*args, **kwargs)
            self.probs.append(float(logits[-1].softmax(-1).max()))
            return logits, feat

    proposer = Recorded(moa_proposer(tiny_llama).drafter)
    cache = model.new_cache(64)
    out = model(torch.tensor([PROMPTS[1]]), cache)
    tokens = PROMPTS[1] + [int(out.logits[0, -1].argmax())]
    proposer.begin(cache, out.hidden[0])
    proposer.probs = []
    full = proposer.propose(tokens, 6, SamplingParams(), None).tokens.tolist()
    probs = proposer.probs  # of drafts 1..6
    for cut in range(1, 6):  # a threshold just above draft cut+1's probability, at or below those before it
        threshold = probs[cut] + 1e-6
        want = 1 + next((i for i, q in enumerate(probs[1:]) if q < threshold), 5)
        proposer.commit(cache.length)  # nothing verified: back to the same state
        proposer.probs, proposer.confidence = [], threshold
        assert proposer.propose(tokens, 6, SamplingParams(), None).tokens.tolist() == full[:want]

    cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    for confidence in (0.05, 0.3, 0.999999):
        confident = moa_proposer(tiny_llama)
        confident.confidence = confidence
        for prompt in PROMPTS:
            got = generate_chain(model, tok, confident, prompt, cfg, draft_len=6)
            assert got.token_ids == generate(model, tok, prompt, cfg).token_ids
            if confidence > 0.99:  # no later draft is that sure: every chain is one draft long
                assert max(got.accepted_lengths) <= 2


def test_chain_stops_on_eos_and_budget_like_vanilla(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    model, tok = tiny_llama.model, tiny_llama.tokenizer
    for budget in (1, 2, 5, 13):
        cfg = GenerationConfig(max_new_tokens=budget)
        want = generate(model, tok, PROMPTS[0], cfg)
        got = generate_chain(model, tok, OracleProposer(model), PROMPTS[0], cfg, draft_len=6)
        assert (got.token_ids, got.finish_reason, got.text) == (want.token_ids, want.finish_reason, want.text)


def test_time_in_the_drafter_counts_as_drafting(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """``draft_s`` holds proposing *and* taking in verified tokens (MoA's LSA runs in ``commit``)."""
    import time

    class SlowCommit(OracleProposer):
        def commit(self, verified: int, path=None, hidden=None) -> None:  # type: ignore[no-untyped-def]
            time.sleep(0.02)

    model, tok = tiny_llama.model, tiny_llama.tokenizer
    got = generate_chain(model, tok, SlowCommit(model), PROMPTS[0], GenerationConfig(max_new_tokens=12), draft_len=2)
    commits = got.target_calls - 1  # none after the last verification
    assert got.draft_s >= 0.02 * commits
    assert got.to_dict()["verify_s"] < got.total_s - got.prefill_s - 0.02 * commits


def test_verify_greedy_cases() -> None:
    logits = torch.full((4, 10), -1.0)
    for i, t in enumerate([3, 4, 5, 6]):
        logits[i, t] = 1.0
    assert verify_greedy(torch.tensor([3, 4, 5]), logits) == verify_greedy(torch.tensor([3, 4, 5]), logits)
    assert verify_greedy(torch.tensor([3, 4, 5]), logits).accepted == 3
    assert verify_greedy(torch.tensor([3, 4, 5]), logits).next_token == 6
    assert (verify_greedy(torch.tensor([3, 9, 5]), logits).accepted, verify_greedy(torch.tensor([3, 9, 5]), logits).next_token) == (1, 4)
    assert verify_greedy(torch.tensor([], dtype=torch.long), logits[:1]).next_token == 3


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare

    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    expected = probs[keep].double() / probs[keep].double().sum() * counts.sum().double()
    return float(chisquare(counts[keep].double().numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("seed", [0, 1])
def test_verify_sampling_keeps_the_target_distribution(seed: int) -> None:
    """Over many draws, the token emitted at the first draft position follows p exactly, whatever q is."""
    g = torch.Generator().manual_seed(seed)
    V, T, n = 6, 3, 40_000
    p = torch.softmax(torch.randn(T + 1, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(T, V, generator=g) * 1.5, -1)
    q[0, 2] = 0.0  # the drafter can never propose token 2: the residual must supply it
    q = q / q.sum(-1, keepdim=True)
    first = torch.zeros(V)
    second_given_accept = torch.zeros(V)
    for _ in range(n):
        draft = sample(q, g)
        v = verify_sampling(draft, q, p, g)
        tok0 = int(draft[0]) if v.accepted >= 1 else v.next_token
        first[tok0] += 1
        if v.accepted >= 1 and int(draft[0]) == 0:
            second_given_accept[int(draft[1]) if v.accepted >= 2 else v.next_token] += 1
    assert chi_square_p(first, p[0]) > 1e-3
    assert chi_square_p(second_given_accept, p[1]) > 1e-3


def test_verify_sampling_with_one_hot_distributions_is_greedy() -> None:
    p = probabilities(torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]]), SamplingParams())
    q = torch.nn.functional.one_hot(torch.tensor([1]), 3).float()
    assert verify_sampling(torch.tensor([1]), q, p, None).accepted == 1
    assert verify_sampling(torch.tensor([1]), q, p, None).next_token == 0


@pytest.mark.parametrize("kind", ["moa", "moa-vocab", "eagle", "independent"])
def test_sampled_chain_runs_and_is_reproducible(tiny_llama, kind: str) -> None:  # type: ignore[no-untyped-def]
    model, tok = tiny_llama.model, tiny_llama.tokenizer
    cfg = GenerationConfig(max_new_tokens=30, ignore_eos=True, sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=5))
    make = {"moa": lambda: moa_proposer(tiny_llama), "moa-vocab": lambda: moa_proposer(tiny_llama, vocab=100),
            "eagle": lambda: eagle_proposer(tiny_llama), "independent": lambda: independent_proposer(tiny_llama)}[kind]
    a = generate_chain(model, tok, make(), PROMPTS[1], cfg)
    b = generate_chain(model, tok, make(), PROMPTS[1], cfg)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30


def fitted(proposer, loaded, tokens: list[int], steps: int = 150):  # type: ignore[no-untyped-def]
    """The proposer's drafter fitted to the target's final states along ``tokens`` (so that it accepts often)."""
    from moaspec.training.features import target_pass

    d = proposer.drafter
    seq = torch.tensor([tokens])
    final = target_pass(loaded.model, seq, 0).final
    opt = torch.optim.Adam([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    d.train()
    for _ in range(steps):
        pred = d(seq, final) if isinstance(d, EagleDrafter) else d(seq)
        loss = torch.nn.functional.mse_loss(pred, final)
        opt.zero_grad()
        loss.backward()
        opt.step()
    d.eval()
    return type(proposer)(d)


@pytest.mark.parametrize("kind", ["eagle", "independent"])
def test_replayed_cycles_equal_real_chain_decoding(tiny_llama, kind: str) -> None:  # type: ignore[no-untyped-def]
    """accepted_runs + simulate_chain (training's val_tau_decode) accept, cycle for cycle, what greedy chain-6 decoding
    accepts — for EAGLE, whose later drafts read its own predicted features, and for an independent drafter."""
    from moaspec.training.dataset import Example, collate
    from moaspec.training.distill import accepted_runs, full_argmax, simulate_chain, step_matches
    from moaspec.training.features import target_pass

    model, tok = tiny_llama.model, tiny_llama.tokenizer
    cfg = GenerationConfig(max_new_tokens=60, ignore_eos=True)
    accepted = 0
    for prompt in PROMPTS:
        want = generate(model, tok, prompt, cfg).token_ids
        base = eagle_proposer(tiny_llama) if kind == "eagle" else independent_proposer(tiny_llama)
        proposer = fitted(base, tiny_llama, prompt + want)
        res = generate_chain(model, tok, proposer, prompt, cfg, draft_len=6)
        assert res.token_ids == want
        batch = collate([Example(tuple(prompt + want), len(prompt), greedy=True)])
        with torch.no_grad():
            tgt = target_pass(model, batch.tokens, 0)
            matches = step_matches(proposer.drafter, model, batch, tgt, full_argmax(model, tgt.final[0, len(prompt) :]))
            runs = accepted_runs(matches, batch)
        assert simulate_chain(runs[0].tolist(), len(prompt), len(want)) == res.accepted_lengths
        accepted += sum(res.accepted_lengths) - len(res.accepted_lengths)
    assert accepted > 30  # the fitted drafters accept often, so the later steps of cycles are exercised
