"""Where a drafting cycle's time goes, per drafter: the drafter's own calls timed inside real tree decoding.

MoA drafts at a higher cost per cycle than EAGLE (BENCHMARKS.md, ``--json``'s ``draft_s``);
this splits that cost into the drafter's two calls, timed by wrapping them: ``observe``
(taking in the newly verified tokens: for MoA its Layer Self-Attention over every target
layer's K/V and the Cross-Attention memory entries; EAGLE has none) and ``step`` (one tree
level: a draft forward and its head). Medians per call, since ``observe`` also takes in each
prompt whole (in prefill, outside ``draft_s``). Greedy, the default tree, first turns of SpecBench;
the drafters run one after the other on the same prompts, after a short warm-up each, once per
precision in ``--dtypes``, named as ``--drafter-dtype`` names them (by default "int8", what drafters
use on CPUs with bf16 kernels, then "float32" and "bfloat16"; the precision a drafter drafts in is
independent of the target's, see ``drafting_precision``).

    .venv/bin/python benchmarks/draft_cost.py --threads 1 --per-file 2 --max-new-tokens 128
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import specbench_script  # beside this script
from moaspec.chat import chat_messages, encode_chat
from moaspec.decoding import GenerationConfig
from moaspec.decoding.tree import TreeShape
from moaspec.drafters import load_drafter, shipped_drafter
from moaspec.strategy import Strategy

TIMED = ("observe", "step")  # the drafter calls a decoding cycle makes


def timing(drafter: Any, totals: dict[str, list[float]]) -> None:
    """Wrap ``drafter``'s TIMED methods (those it has) so each call appends its seconds to ``totals[name]``."""
    for name in TIMED:
        method = getattr(drafter, name, None)
        if method is None:
            continue

        def timed(*args: Any, _method: Callable[..., Any] = method, _name: str = name, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = _method(*args, **kwargs)
            totals[_name].append(time.perf_counter() - start)
            return out

        setattr(drafter, name, timed)


def main() -> None:
    ap = specbench_script.parser(__doc__, per_file=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--compare", default=None,
                    help="a second drafter directory (default: the shipped EAGLE drafter beside the shipped MoA one)")
    ap.add_argument("--dtypes", default="int8,float32,bfloat16",
                    help="the drafters' precisions (--drafter-dtype's names), each run in turn")
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    lm, first = specbench_script.target_and_drafter_path(args)
    second = args.compare or shipped_drafter(lm, "eagle")
    if second is None:
        raise SystemExit("no EAGLE drafter ships for this target: name one with --compare")
    prompts = [encode_chat(lm.tokenizer, chat_messages(q.turns[0])) for q in specbench_script.questions(args)]
    results = {}
    for path, dtype in ((p, d) for p in (first, str(second)) for d in dtypes):
        strategy = Strategy(load_drafter(path, lm, dtype), tree=TreeShape())
        strategy.run(lm, prompts[0], GenerationConfig(max_new_tokens=16))  # warm-up
        totals: dict[str, list[float]] = defaultdict(list)
        timing(strategy.drafter, totals)
        draft_s, cycles, tokens = 0.0, 0, 0
        for ids in prompts:
            out = strategy.run(lm, ids, GenerationConfig(max_new_tokens=args.max_new_tokens)).to_dict()
            draft_s, cycles, tokens = draft_s + out["draft_s"], cycles + out["target_calls"], tokens + out["new_tokens"]
        row = {"cycles": cycles, "tau": round(tokens / cycles, 3), "draft_ms_per_cycle": round(1e3 * draft_s / cycles, 2)}
        for name, seconds in totals.items():
            row[f"{name}_calls_per_cycle"] = round(len(seconds) / cycles, 2)
            row[f"{name}_median_ms_per_call"] = round(1e3 * statistics.median(seconds), 2)
        name = f"{path} {dtype}"
        results[name] = row
        print(name)
        for key, value in row.items():
            print(f"  {key:28s} {value}")
    specbench_script.write_results(args, drafters=results)


if __name__ == "__main__":
    main()
