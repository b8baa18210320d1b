"""``moaspec tune``: measure this host's decoding costs carefully, refresh the drafter's from real decoding, keep them.

The cost-aware policy (:mod:`moaspec.decoding.policy`) measures the target's costs itself at first use, in a
few rounds. ``tune`` takes more rounds, then decodes its prompts beside plain decoding, greedy, interleaved
per prompt as ``moaspec bench`` runs its methods (it is :func:`moaspec.bench.run.run_bench`: resumable,
answers and plots in the run directory). That times the drafter in real cycles and checks every answer
against plain decoding's; the costs are then saved for :mod:`moaspec.costs` to read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moaspec.bench.methods import strategy_method
from moaspec.bench.run import run_bench
from moaspec.costs import measured_costs
from moaspec.decoding.policy import MAX_CHAIN, MAX_NEW, Costs, Policy
from moaspec.decoding.sampling import SamplingParams
from moaspec.drafters.base import Drafter
from moaspec.errors import MoaspecError
from moaspec.models.loading import LoadedModel
from moaspec.specbench import Question
from moaspec.strategy import Strategy

PROMPTS = Path(__file__).resolve().parent.parent / "assets" / "tune_prompts.jsonl"  # written for tuning, not SpecBench
ROUNDS = 7  # of every forward size, against the policy's 3 at first use


def tune(target: LoadedModel, drafter: Drafter, questions: list[Question], max_new: int, output: Path,
         progress: bool = True) -> tuple[Costs, dict[str, Any]]:
    """Measure the target's costs, then decode ``questions`` by cost beside plain decoding; the refreshed costs and
    the run's summary.

    Every answer must equal plain decoding's (greedy): a difference is a bug, and nothing is kept.
    """
    policy = Policy(measured_costs(target.model, ROUNDS), source="moaspec tune")
    greedy = SamplingParams()
    methods = {"vanilla": strategy_method(target, Strategy(), greedy),
               "by-cost": strategy_method(target, Strategy(drafter, chain=MAX_CHAIN, lookup=MAX_NEW - 1, policy=policy),
                                          greedy)}
    summary = run_bench(target, questions, methods, max_new, output, progress=progress, settings={"tune": "by-cost"})
    overall = {name: per["overall"] for name, per in summary["results"].items()}
    if overall["by-cost"]["greedy_mismatches"]:
        raise MoaspecError(f"decoding by cost did not reproduce plain decoding's greedy answers (a bug: please report "
                           f"it with {output}/answers.jsonl); nothing was saved")
    return policy.costs, summary


def report(summary: dict[str, Any], costs: Costs) -> str:
    """The costs measured, and decoding by cost against plain decoding on the prompts."""
    sizes = (1, 2, 4, 8, 16)
    lines = ["target forward, ms by new tokens: " + ", ".join(f"{k}: {1e3 * costs.verify_s(k):.1f}" for k in sizes),
             f"drafter, ms: first draft of a cycle {1e3 * costs.draft_first:.2f}, each further {1e3 * costs.draft_next:.2f}"]
    overall = {name: per["overall"] for name, per in summary["results"].items()}
    for name in ("vanilla", "by-cost"):
        r = overall[name]
        lines.append(f"{name:<10}{r['tokens_per_s']:>8.1f} tok/s{r['speedup']:>7.2f}x  tau {r['tau']:.2f}")
    return "\n".join(lines)
