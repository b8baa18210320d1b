"""The cost-aware speculation policy: its decision rule as pure functions, its estimates, and its choices."""

from __future__ import annotations

import pytest

from moaspec.decoding.policy import (
    BINS,
    CAP,
    EXPLORE_UNREAD,
    MAX_CHAIN,
    MAX_NEW,
    OUTLIER,
    Acceptance,
    Costs,
    Policy,
    Rate,
    Speculation,
    best_extension,
    drafter_rate,
    extend,
)

MS = 1e-3


def cpu_costs() -> Costs:
    """A 2-core AVX2 CPU's 4-bit target: each extra verified token ~2.5 ms against an 11.4 ms step."""
    return Costs([(11.4 + 2.5 * k) * MS for k in range(MAX_NEW)], 3.3 * MS, 2.0 * MS)


def gpu_costs() -> Costs:
    """A GPU: verifying 16 tokens costs what one does; drafts are a twentieth of a step or less."""
    return Costs([10 * MS] * MAX_NEW, 0.5 * MS, 0.3 * MS)


# --- the rule ------------------------------------------------------------------------------------


def test_a_draft_is_added_only_while_it_raises_the_expected_rate() -> None:
    # 1 token in 10 s; a sure draft for 1 s more: 2 tokens in 11 s beats 1 in 10
    assert best_extension(1.0, 10.0, 1.0, [1.0], [1.0]) == (1, pytest.approx(2 / 11))
    # a draft accepted 10% of the time for 2 s more: 1.1 tokens in 12 s loses to 1 in 10
    assert best_extension(1.0, 10.0, 1.0, [0.1], [2.0]) == (0, pytest.approx(0.1))
    # a weak second draft is not taken just because the first was good
    n, tokens, seconds = extend(1.0, 10.0, 1.0, [0.9, 0.05], [1.0, 3.0])
    assert (n, tokens, seconds) == (1, pytest.approx(1.9), pytest.approx(11.0))
    # a good draft behind a middling one is worth going through it for
    assert extend(1.0, 10.0, 1.0, [0.5, 1.0, 1.0], [4.0, 5.0, 6.0])[0] == 3
    # ties go to fewer drafts, and ``reach`` discounts every draft after drafts not yet sure
    assert best_extension(1.0, 10.0, 1.0, [0.1], [1.0])[0] == 0
    assert best_extension(1.5, 12.0, 0.0, [1.0], [0.1])[0] == 0


def test_the_drafter_is_worth_a_cycle_where_it_is_often_sure_and_verification_is_cheap() -> None:
    accept = [(b + 0.5) / BINS for b in range(BINS)]
    sure = [0.0] * (BINS - 2) + [0.5, 0.5]  # its first drafts all at probability 0.8 or more
    unsure = [0.2] * 5 + [0.0] * 5  # all below 0.5
    c = cpu_costs()
    extra = [c.verify_s(j + 2) - c.verify_s(1) for j in range(4)]
    plain = 1 / c.verify_s(1)
    n, rate = drafter_rate(c.verify_s(1), c.draft_first, c.draft_next, extra, sure, accept, [0.6] * 3)
    assert n >= 1 and rate > plain
    n, rate = drafter_rate(c.verify_s(1), c.draft_first, c.draft_next, extra, unsure, accept, [0.6] * 3)
    assert rate < plain  # on a CPU an unsure drafter costs more than it brings
    g = gpu_costs()
    n, rate = drafter_rate(g.verify_s(1), g.draft_first, g.draft_next, [0.0] * 4, unsure, accept, [0.6] * 3)
    assert n == 4 and rate > 1 / g.verify_s(1)  # where verification is free, the whole chain pays
    # every bin's seconds include the first draft: a drafter that is never sure only costs
    never = [1.0] + [0.0] * (BINS - 1)
    n, rate = drafter_rate(c.verify_s(1), c.draft_first, c.draft_next, extra, never, accept, [0.6] * 3)
    assert n == 0 and rate == pytest.approx(1 / (c.verify_s(1) + c.draft_first))


# --- the estimates -------------------------------------------------------------------------------


def test_costs_follow_timings_but_a_stall_moves_them_only_so_far() -> None:
    c = cpu_costs()
    assert c.verify_s(MAX_NEW + 4) > c.verify_s(MAX_NEW)  # past the table: grown in step
    before = c.verify_s(4)
    for _ in range(50):
        c.timed_target(1, 2 * 11.4 * MS)  # a host twice as busy: every size follows, the one timed and the rest
    assert c.verify_s(1) == pytest.approx(2 * 11.4 * MS, rel=0.05) and c.verify_s(4) > 1.7 * before
    c = cpu_costs()
    c.timed_target(3, 5.0)  # one forward paused for 5 s (a preempted process) counts as OUTLIER times the estimate
    assert c.scale == pytest.approx(1 + 0.2 * (OUTLIER - 1))
    c.timed_draft(True, 10.0)
    assert c.draft_first < 3.3 * MS * OUTLIER
    with pytest.raises(ValueError, match="positive seconds"):
        Costs([0.0] * MAX_NEW, 1.0, 1.0)


def test_acceptance_counts_fade_and_only_outcomes_reached_are_recorded() -> None:
    r = Rate(0.0, 1.0)
    for _ in range(200):
        r.add(True)
    assert r.tries == CAP and r.p > 0.95  # the last couple of dozen outcomes decide
    cells = [Rate(0.0, 0.0) for _ in range(4)]
    Acceptance.record(cells, proposed=4, accepted=1)  # kept one, the second rejected, the rest never reached
    assert [(c.hits, c.tries) for c in cells] == [(1, 1), (0, 1), (0, 0), (0, 0)]
    Acceptance.record(cells, proposed=2, accepted=2)
    assert [(c.hits, c.tries) for c in cells[:2]] == [(2, 2), (1, 2)]
    a = Acceptance()
    for row in a.lookup:
        for c in row:
            c.hits, c.tries = 90.0, 100.0
    light = a.copy(weight=4.0)
    assert light.lookup[0][0].tries == 4.0 and light.lookup[0][0].p == pytest.approx(0.9)  # same rate, less weight
    b = a.copy()
    for _ in range(10):
        Acceptance.record(b.lookup[0], 1, 0)
    a.blend(b)
    assert a.lookup[0][0].p < 0.9 and a.lookup[1][0].p == pytest.approx(0.9)


# --- the choices ---------------------------------------------------------------------------------


def speculation(costs: Costs, lookup: float = 0.0, drafter: float = 0.0, sure: float = 0.1) -> Speculation:
    a = Acceptance()
    for row in a.lookup:
        for c in row:
            c.hits, c.tries = lookup * 10, 10.0
    for c in a.by_depth:
        c.hits, c.tries = drafter * 10, 10.0
    a.first = [(1 - sure) / 4] * 4 + [0.0] * (BINS - 5) + [sure]  # unsure (below 0.4) but for a share ``sure``
    return Speculation(costs, a, drafter=True)


def test_the_plan_copies_what_lookup_gets_right_drafts_where_it_pays_and_else_steps_plainly() -> None:
    assert speculation(cpu_costs(), lookup=0.99).plan(copied=8, drafter_most=8) == ("lookup", 8)
    kind, n = speculation(cpu_costs(), lookup=0.4).plan(copied=8, drafter_most=0)
    assert kind == "lookup" and 1 <= n < 8  # a middling copy: its first tokens only
    assert speculation(cpu_costs(), lookup=0.1, drafter=0.3).plan(copied=8, drafter_most=8) == ("plain", 0)
    assert speculation(gpu_costs(), drafter=0.7).plan(copied=0, drafter_most=8)[0] == "drafter"
    assert speculation(cpu_costs(), drafter=0.7, sure=0.9).plan(copied=0, drafter_most=8)[0] == "drafter"
    s = speculation(cpu_costs(), drafter=0.0, sure=0.3)  # close to paying (0.97 of a plain step's rate)
    assert [s.plan(0, 8)[0] for _ in range(17)][-1] == "drafter"  # a look now and then: acceptance moves
    assert s.cycles["plain"] == 16 and s.cycles["drafter"] == 1
    far = speculation(cpu_costs(), drafter=0.0, sure=0.1)  # 0.87 of it: a look would not pay for its catch-up
    assert {far.plan(0, 8)[0] for _ in range(300)} == {"plain"}
    # nor a look whose drafter would first read a long prompt; one expected to pay still drafts at once
    unread = speculation(cpu_costs(), drafter=0.0, sure=0.3)
    assert {unread.plan(0, 8, unread=EXPLORE_UNREAD + 1)[0] for _ in range(300)} == {"plain"}
    assert unread.plan(0, 8, unread=EXPLORE_UNREAD)[0] == "drafter"  # the wait is over: a prompt this short is read
    assert speculation(cpu_costs(), drafter=0.7, sure=0.9).plan(0, 8, unread=10_000)[0] == "drafter"


def test_a_tree_is_grown_where_it_pays_and_looked_at_now_and_then_only_where_it_comes_close() -> None:
    def trees(tokens: float, cycles: int = 300) -> set[bool]:
        s = speculation(cpu_costs())
        s.acceptance.tree_tokens, s.acceptance.tree_draft_s = tokens, 4 * MS
        return {s.plan_tree(4) for _ in range(cycles)}

    # a 4-node tree verifies in 11.4 + 7.5 ms and drafts in 4: it pays where it brings more than 2.0 tokens
    assert trees(2.2, 5) == {True}
    assert trees(1.95) == {True, False}  # 0.97 of a plain step's rate: tried now and then, acceptance moves
    assert trees(1.5) == {False}  # 0.75 of it: a look would not pay for its drafting


def test_while_the_target_runs_other_requests_forwards_too_every_cycle_is_a_plain_step() -> None:
    """A busy server batches its requests' forwards: each token of a batch costs about what a plain step does, so
    a sure copy and a sure drafter both give way, and they come back as soon as the batches end."""
    busy = [True]
    policy = Policy(gpu_costs())
    s = policy.request(drafter=True, crowded=lambda: busy[0])
    for row in s.acceptance.lookup:
        for c in row:
            c.hits, c.tries = 9.9, 10.0
    s.acceptance.tree_tokens, s.acceptance.tree_draft_s = 3.0, 0.1 * MS
    assert s.plan(copied=8, drafter_most=8) == ("plain", 0) and not s.plan_tree(4)
    busy[0] = False
    assert s.plan(copied=8, drafter_most=8) == ("lookup", 8) and s.plan_tree(4)
    seeded = policy.request(drafter=True, seed=1, crowded=lambda: True)  # a seeded request's draws never depend on the load
    assert seeded.crowded is None


def test_while_drafting_sure_drafts_are_kept_and_unsure_ones_dropped() -> None:
    s = speculation(cpu_costs(), drafter=0.7, sure=0.9)
    assert s.plan(0, MAX_CHAIN) == ("drafter", pytest.approx(s.plan(0, MAX_CHAIN)[1]))
    assert s.keep(0, 0.97)  # its first draft is nearly sure: worth verifying
    assert not s.keep(1, 0.05)  # its second is a guess: not worth 2.5 ms of verification
    s.outcome(1, 1)
    assert s.acceptance.by_probability[BINS - 1].tries > 4.0  # what the drafter's confidence was worth is learned


def test_a_policy_shares_its_costs_and_starts_each_request_from_what_the_last_ones_saw() -> None:
    kept = []
    policy = Policy(cpu_costs(), keep=kept.append)
    first = policy.request(drafter=False)
    first.timed(1, 20 * MS)
    assert policy.costs.scale > 1  # the host's costs, shared
    for _ in range(10):
        first.plan(copied=4, drafter_most=0)
        first.outcome(4, 0)
    policy.finished(first)
    assert kept == [policy.costs]
    second = policy.request(drafter=False)
    assert second.acceptance.lookup[0][0].p < Acceptance().lookup[0][0].p  # lookup kept failing: the next starts wary
    assert max(c.tries for c in second.acceptance.cells()) <= 4.0  # and soon learns its own
    seeded = policy.request(drafter=True, seed=7)  # decides by the costs as measured, alone: the same draws every time
    seeded.timed(1, 1.0)
    assert seeded.costs is not policy.costs and seeded.costs.target == cpu_costs().target
    assert seeded.acceptance.lookup[0][0].p == Acceptance().lookup[0][0].p


# --- lossless ------------------------------------------------------------------------------------


@pytest.mark.parametrize("costs", [cpu_costs, gpu_costs, lambda: Costs([1.0 + 0.25 * k for k in range(MAX_NEW)], 0.05, 0.05)],
                         ids=["cpu", "gpu", "dear-verification"])
def test_greedy_output_by_cost_is_plain_decodings(tiny_llama, tiny_moa_dir, costs) -> None:  # type: ignore[no-untyped-def]
    from moaspec.api import decoding_strategy
    from moaspec.decoding import GenerationConfig
    from moaspec.decoding.tree import TreeShape
    from moaspec.strategy import Strategy

    drafter = decoding_strategy(tiny_llama, tiny_moa_dir, by_cost=False).drafter
    policy = Policy(costs())
    cycles = {"plain": 0, "lookup": 0, "drafter": 0, "tree": 0}
    finished = policy.finished

    def count(s: Speculation) -> None:
        for kind, n in s.cycles.items():
            cycles[kind] += n
        finished(s)

    policy.finished = count  # type: ignore[method-assign]
    plain = Strategy()
    chains = Strategy(drafter, chain=MAX_CHAIN, lookup=MAX_NEW - 1, policy=policy)
    tree = Strategy(drafter, tree=TreeShape(2, 2, 4), lookup=0, policy=policy)
    cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    for prompt in ([1, 5, 9, 5, 9, 5, 9, 5], [3, 3, 3, 3], [7, 2, 11, 4, 8, 19, 2, 11]):
        want = plain.run(tiny_llama, prompt, cfg).token_ids
        assert chains.run(tiny_llama, prompt, cfg).token_ids == want
        assert tree.run(tiny_llama, prompt, cfg).token_ids == want
    assert cycles["plain"] + cycles["tree"] > 0 and cycles["lookup"] + cycles["drafter"] > 0, cycles


def test_a_greedy_request_with_a_seed_learns_as_an_unseeded_one(tiny_llama, tiny_moa_dir) -> None:  # type: ignore[no-untyped-def]
    """A seed holds a request to the costs as measured only where it draws tokens: a greedy answer is the same
    whatever is drafted (``moaspec bench`` passes its seed, 0, to greedy runs too)."""
    from moaspec.api import decoding_strategy
    from moaspec.decoding import GenerationConfig, SamplingParams

    strategy = decoding_strategy(tiny_llama, tiny_moa_dir, by_cost=True)
    assert strategy.policy is not None
    seeds: list[int | None] = []
    request = strategy.policy.request
    strategy.policy.request = lambda drafter, seed=None, crowded=None: (  # type: ignore[method-assign]
        seeds.append(seed), request(drafter, seed, crowded))[1]
    for sampling in (SamplingParams(0.0, seed=0), SamplingParams(0.8, seed=5)):
        strategy.run(tiny_llama, [1, 2, 3], GenerationConfig(max_new_tokens=4, sampling=sampling))
    assert seeds == [None, 5]


def test_a_tree_by_cost_that_never_drafts_never_reads_the_prompt(tiny_llama, tiny_moa_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The drafter reads the prompt at its first tree: a request whose every cycle is a plain step never pays
    for it, and one that drafts late reads the prompt and the steps before in one piece (output stays plain's)."""
    from moaspec.api import decoding_strategy
    from moaspec.decoding import GenerationConfig
    from moaspec.decoding.tree import TreeShape
    from moaspec.drafters.proposers import DrafterProposer
    from moaspec.strategy import Strategy

    begun: list[int] = []
    begin = DrafterProposer.begin
    monkeypatch.setattr(DrafterProposer, "begin", lambda self, cache, hidden=None, known=None: (
        begun.append(cache.length), begin(self, cache, hidden, known))[1])
    drafter = decoding_strategy(tiny_llama, tiny_moa_dir, by_cost=False).drafter
    cfg = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    prompt = [7, 2, 11, 4, 8, 19, 2, 11]
    want = Strategy().run(tiny_llama, prompt, cfg).token_ids
    never = Policy(Costs([1.0 + k for k in range(MAX_NEW)], 10.0, 10.0))  # a tree costs ten plain steps to draft
    assert Strategy(drafter, tree=TreeShape(2, 2, 4), policy=never).run(tiny_llama, prompt, cfg).token_ids == want
    assert begun == []
    late = Policy(Costs([1.0 + 0.01 * k for k in range(MAX_NEW)], 0.01, 0.01))
    s = late.request(drafter=True)
    monkeypatch.setattr(late, "request", lambda *a, **k: s)
    plans = iter([False] * 5)
    monkeypatch.setattr(s, "plan_tree", lambda nodes: next(plans, True))  # five plain steps, then trees
    assert Strategy(drafter, tree=TreeShape(2, 2, 4), policy=late).run(tiny_llama, prompt, cfg).token_ids == want
    assert begun == [len(prompt) + 5]  # the prompt and the five steps' positions, read at the first tree
