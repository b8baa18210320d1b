"""benchmarks/disconnection.py on a tiny random target: kept tokens are counted on the real resynchronisation, and the
expected kept tokens of a sampling target follow from the target's probabilities exactly."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moaspec.clientserver.bench import perplexity
from moaspec.clientserver.sessions import Limits, SessionStore
from moaspec.decoding import GenerationConfig, generate
from moaspec.drafters.independent import IndependentConfig, IndependentDrafter
from moaspec.serving import Engine, create_app
from moaspec.strategy import Strategy
from servers import running

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
try:
    import disconnection
finally:
    sys.path.pop(0)

PROMPT = [5, 17, 42, 7, 99, 3, 12]
CUTS, ALONES = [3, 6], [6, 9]  # at least the drafts in flight at the cut (2 × chain + 1)


@pytest.fixture(scope="module")
def upstream(tiny_llama, tiny_moa) -> Iterator[tuple[str, int]]:  # type: ignore[no-untyped-def]
    store = SessionStore(tiny_llama, tiny_moa, Limits())
    with running(create_app(Engine(tiny_llama, Strategy(tiny_moa), parallel=1), "tiny", sessions=store)) as url:
        yield "127.0.0.1", int(url.rsplit(":", 1)[1])


def independent(tiny_llama, layers: int, vocabulary: list[int] | None = None) -> IndependentDrafter:  # type: ignore[no-untyped-def]
    """The target's first ``layers`` blocks as a drafter, drafting only from ``vocabulary`` when given."""
    d = IndependentDrafter(IndependentConfig.for_target(tiny_llama.cfg, layers=layers,
                                                        draft_vocab_size=len(vocabulary) if vocabulary else 0))
    d.copy_target_layers(tiny_llama.model)
    if vocabulary:
        d.set_draft_vocab(torch.tensor(vocabulary))
    d.attach(tiny_llama.model)
    return d.eval()


def study(tiny_llama, drafter, upstream):  # type: ignore[no-untyped-def]
    """(offline length, its figures, the cut run's) for every cut point and offline length."""
    runs = disconnection.study_prompt(tiny_llama, drafter, upstream, PROMPT, CUTS, ALONES, chain=2, temperature=0.7)
    assert sorted(runs) == ["3", "6"]
    for per in runs.values():
        assert len(per["alone"]) == max(ALONES)
        assert per["after_reconnection"]["calls"] >= 1 and per["uncut"]["calls"] >= 1
        assert per["after_reconnection"]["read"] >= per["after_reconnection"]["calls"]
    return [(n, runs[str(k)][str(n)], runs[str(k)]) for k in CUTS for n in ALONES]


def test_a_drafter_that_is_the_target_has_everything_kept(tiny_llama, upstream) -> None:  # type: ignore[no-untyped-def]
    for n, r, cut in study(tiny_llama, independent(tiny_llama, tiny_llama.cfg.num_layers), upstream):
        assert r["kept"] == r["kept_by_own_text"] == n
        assert r["perplexity"] == pytest.approx(r["target"]["perplexity"])  # it wrote the target's own text
        assert 3 <= cut["verified_before_cut"] <= 6 + 2  # the verification that crossed the cut ends it
        # the whole offline text is checked in one verification (it fits in one piece) instead of several
        assert cut["after_reconnection"]["calls"] < cut["uncut"]["calls"]


def test_a_drafter_that_always_disagrees_has_nothing_kept(tiny_llama, upstream) -> None:  # type: ignore[no-untyped-def]
    answer = generate(tiny_llama.model, tiny_llama.tokenizer, PROMPT,
                      GenerationConfig(max_new_tokens=32, ignore_eos=True)).token_ids
    never = next(t for t in range(tiny_llama.cfg.vocab_size) if t not in answer)  # the target never writes it here
    for _, r, cut in study(tiny_llama, independent(tiny_llama, 1, [never]), upstream):
        assert cut["alone"] == [never] * max(ALONES) and r["kept"] == r["kept_by_own_text"] == 0
        assert r["expected_kept_t0.7"] < 0.5 and r["perplexity"] > r["target"]["perplexity"]


def test_moa_offline_text_is_kept_as_far_as_it_is_the_targets(tiny_llama, tiny_moa, upstream) -> None:  # type: ignore[no-untyped-def]
    """What the resynchronisation kept is the offline text's common prefix with the target's own greedy text."""
    for n, r, _ in study(tiny_llama, tiny_moa, upstream):
        assert 0 <= r["kept"] == r["kept_by_own_text"] <= n
        assert 0 < r["distinct_4grams"] <= 1 and r["perplexity"] >= 1


def test_expected_kept_tokens_of_a_sampling_target() -> None:
    """sum_k prod_{i<=k} p_i equals the mean of the kept count over every accept/reject outcome, weighted by its
    chance; certainty keeps everything, a zero stops the count; a probability outside [0, 1] is refused."""
    probs = [0.9, 0.5, 0.7, 0.2]
    exact = 0.0
    for outcome in itertools.product([True, False], repeat=len(probs)):
        chance = 1.0
        for accepted, p in zip(outcome, probs):
            chance *= p if accepted else 1 - p
        exact += chance * next((i for i, a in enumerate(outcome) if not a), len(probs))
    assert disconnection.expected_kept(probs) == pytest.approx(exact)
    assert disconnection.expected_kept([1.0] * 5) == 5 and disconnection.expected_kept([1.0, 0.0, 1.0]) == 1
    assert disconnection.expected_kept([]) == 0
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        disconnection.expected_kept([0.5, 1.5])


def test_scores_of_the_targets_own_text(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """At a temperature near 0 the target keeps its own greedy text whole; a prefix's perplexity is that of the
    prefix alone; a distinct 4-gram share counts repeats."""
    own = generate(tiny_llama.model, tiny_llama.tokenizer, PROMPT, GenerationConfig(max_new_tokens=6, ignore_eos=True))
    scores = disconnection.score_prefixes(tiny_llama, PROMPT, own.token_ids, [2, 6], 1e-4)
    assert scores["2"]["expected_kept_t0.0001"] == pytest.approx(2, abs=1e-3)
    assert scores["6"]["expected_kept_t0.0001"] == pytest.approx(6, abs=1e-3)
    assert scores["6"]["perplexity"] == pytest.approx(perplexity(tiny_llama, PROMPT, own.token_ids), rel=1e-5)
    assert scores["2"]["perplexity"] == pytest.approx(perplexity(tiny_llama, PROMPT, own.token_ids[:2]), rel=1e-5)
    assert disconnection.distinct_4grams([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 - 1 / 5)


def fake_row(kept: dict[str, int]) -> dict:  # type: ignore[type-arg]
    """One prompt's figures, cut after 32 verified tokens, 8 tokens written alone, ``kept[method]`` of them kept."""
    def cut(k: int) -> dict:  # type: ignore[type-arg]
        figures = {"perplexity": 2.0, "distinct_4grams": 0.5, "expected_kept_t0.7": 1.0}
        return {"verified_before_cut": 33, "alone": [1] * 8, "after_reconnection": {"s": 1.0, "calls": 3, "read": 70},
                "uncut": {"s": 1.5, "calls": 4, "read": 12},
                "8": {"kept": k, "kept_by_own_text": k, **figures, "target": {**figures, "perplexity": 1.5}}}
    return {"methods": {m: {"32": cut(k)} for m, k in kept.items()}}


def test_summary_and_table_compare_moa_prompt_by_prompt() -> None:
    """Means per cell, time saved after reconnection, and the sign test on kept tokens (ties dropped)."""
    rows = [fake_row({"moa": 3, "eagle2": 1})] * 6 + [fake_row({"moa": 2, "eagle2": 2})]
    summary = disconnection.summarize(rows, ["moa", "eagle2"], [32], [8], 0.7)
    moa = summary["cells"]["moa"]
    assert moa["32/8"]["kept"] == pytest.approx(20 / 7, abs=1e-3) and moa["32/8"]["fraction_kept"] == pytest.approx(20 / 56, abs=1e-4)
    assert moa["32/8 reconnection"]["saved_s_mean"] == pytest.approx(0.5)
    test = summary["sign_tests"]["moa vs eagle2"]["32/8"]
    assert (test["moa_more"], test["moa_fewer"], test["equal"]) == (6, 0, 1) and test["p"] == pytest.approx(2 / 64)
    text = disconnection.table(summary, 0.7)
    assert "| moa | 32/8 | 2.86 | 35.7% |" in text and "32/8 6/0 (p = 0.0312)" in text
