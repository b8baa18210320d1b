"""``moaspec tune``: measure which chain, tree and prompt-lookup setting decodes fastest on this machine.

What pays depends on the hardware: a drafting step's cost against a verification's,
and how a verification's cost grows with the tokens it checks (flat up to ~16 on the
2-core CPUs of BENCHMARKS.md, up to dozens on a GPU). So the grid below runs beside
plain decoding, greedy, interleaved per prompt as ``moaspec bench`` runs its methods
(it is :func:`moaspec.bench.run.run_bench`: resumable, answers and plots in the run
directory), and the fastest setting is saved for :mod:`moaspec.tuned` to apply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moaspec.bench.methods import Method, strategy_method
from moaspec.bench.run import run_bench
from moaspec.decoding.lookup import DEFAULT_LOOKUP
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.tree import TreeShape
from moaspec.drafters.base import Drafter
from moaspec.errors import MoaspecError
from moaspec.models.loading import LoadedModel
from moaspec.specbench import Question
from moaspec.strategy import Strategy
from moaspec.tuned import PLAIN, Decoding

PROMPTS = Path(__file__).resolve().parent.parent / "assets" / "tune_prompts.jsonl"  # written for tuning, not SpecBench

CHAINS = (1, 2, 3, 4)
TREES = (TreeShape(2, 2, 4), TreeShape(3, 2, 6), TreeShape(3, 3, 10), TreeShape(4, 3, 12))
GPU_CHAINS = (6,)
GPU_TREES = (TreeShape(5, 4, 24), TreeShape(5, 8, 48), TreeShape(6, 8, 62))  # the last: the paper's GPU tree


SHORT_LOOKUP = 4  # on a CPU a verification's cost grows with its tokens


def grid(device_type: str, lookup: int = DEFAULT_LOOKUP) -> list[Decoding]:
    """Every setting tried: chains and trees, each alone and after ``lookup`` prompt-lookup drafts (on a CPU, also
    after :data:`SHORT_LOOKUP`).

    On a GPU, longer chains and the paper's large trees join, since a verification of
    dozens of tokens costs about one decoding step there. On a CPU it does not
    (BENCHMARKS.md, "Against llama.cpp": 16 new tokens cost 3.4 one-token steps on a 2-core EPYC), so fewer
    lookup drafts may pay more.
    """
    gpu = device_type == "cuda"
    chains = CHAINS + GPU_CHAINS if gpu else CHAINS
    trees = TREES + GPU_TREES if gpu else TREES
    shapes = [Decoding(chain=c, lookup=0) for c in chains] + [Decoding(tree=t, lookup=0) for t in trees]
    lookups = [lookup] if gpu or lookup <= SHORT_LOOKUP else [lookup, SHORT_LOOKUP]
    return shapes + [Decoding(d.chain, d.tree, n) for n in lookups for d in shapes] if lookup else shapes


def tune(target: LoadedModel, drafter: Drafter, questions: list[Question], max_new: int, output: Path,
         settings: list[Decoding], progress: bool = True) -> tuple[Decoding, dict[str, Any]]:
    """Run ``settings`` beside plain decoding over ``questions``; the fastest of them and plain decoding
    (:data:`~moaspec.tuned.PLAIN`, which wins where every drafting setting costs more than it saves), and the
    run's summary.

    Every answer must equal plain decoding's (greedy): a difference is a bug, and nothing is chosen.
    """
    greedy = SamplingParams()
    by_name = {d.name(): d for d in settings}
    methods: dict[str, Method] = {"vanilla": strategy_method(target, Strategy(), greedy)}
    methods.update({name: strategy_method(target, Strategy(drafter, chain=d.chain, tree=d.tree, lookup=d.lookup), greedy)
                    for name, d in by_name.items()})
    summary = run_bench(target, questions, methods, max_new, output, progress=progress,
                        settings={"tune": sorted(by_name)})
    overall = {name: per["overall"] for name, per in summary["results"].items()}
    wrong = [name for name, r in overall.items() if r["greedy_mismatches"]]
    if wrong:
        raise MoaspecError(f"{', '.join(wrong)} did not reproduce plain decoding's greedy answers (a bug: please "
                           f"report it with {output}/answers.jsonl); nothing was saved")
    candidates = {**by_name, PLAIN.name(): PLAIN}
    best = max(candidates, key=lambda name: overall[name]["tokens_per_s"])
    return candidates[best], summary


def report(summary: dict[str, Any], best: Decoding, default: Decoding) -> str:
    """The settings by speed, fastest first, with the built-in default and the winner marked."""
    overall = {name: per["overall"] for name, per in summary["results"].items()}
    lines = [f"{'setting':<28}{'tok/s':>8}{'speedup':>9}{'tau':>7}"]
    for name in sorted(overall, key=lambda n: -overall[n]["tokens_per_s"]):
        r = overall[name]
        mark = "  <- fastest" if name == best.name() else "  (built-in default)" if name == default.name() else ""
        lines.append(f"{name:<28}{r['tokens_per_s']:>8.1f}{r['speedup']:>9.2f}{r['tau']:>7.2f}{mark}")
    base = overall.get(default.name(), {}).get("tokens_per_s")
    if base:
        gain = overall[best.name()]["tokens_per_s"] / base - 1
        lines.append(f"the fastest is {gain:+.1%} against the built-in default ({default.name()})"
                     + (": within this kind of run's noise (a few %), so either is fine" if abs(gain) < 0.03 else ""))
    return "\n".join(lines)
