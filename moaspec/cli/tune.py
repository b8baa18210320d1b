"""``moaspec tune``: measure this host's decoding costs for the cost-aware policy and keep them."""

from __future__ import annotations

import argparse
import sys

from moaspec.cli import options
from moaspec.errors import MoaspecError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    u = sub.add_parser("tune", help="measure this host's decoding costs (the target's forward by new tokens, the "
                                    "drafter's per draft) with care, and keep them for generate, serve and moaspec.load")
    u.add_argument("--drafter", default=None, help="the drafter to tune for (default: the one shipped for the target)")
    u.add_argument("--questions", default=None,
                   help="SpecBench-format .jsonl file or directory to decode (default: 12 built-in prompts of six kinds)")
    u.add_argument("--limit", type=int, default=None, help="the first K questions of each file")
    u.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer (default 128)")
    u.add_argument("--output", default=None,
                   help="run directory for answers, summary.json and plots (default: beside the saved costs, in the "
                        "cache); an interrupted run resumes there")
    u.add_argument("--no-save", action="store_true",
                   help="measure and print, but keep the costs saved before (the run directory still keeps the "
                        "answers and summary, so that an interrupted run resumes)")
    u.add_argument("--no-progress", action="store_true")
    options.add_model_options(u)
    options.add_drafter_dtype_option(u)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moaspec.bench.tune import PROMPTS, ROUNDS, report, tune
    from moaspec.costs import costs_file, machine_key, save_costs
    from moaspec.drafters import load_drafter, shipped_drafter
    from moaspec.specbench import check_first_turns_fit, load_questions

    options.require(args, ">= 1", options.at_least(1), "max_new_tokens", "limit")
    questions = load_questions(args.questions or PROMPTS, per_file=args.limit)
    loaded = options.load_target(args)
    check_first_turns_fit(questions, loaded.tokenizer, loaded.cfg.max_position_embeddings)
    path = args.drafter or shipped_drafter(loaded)
    if path is None:
        raise MoaspecError(f"no drafter ships for {loaded.path.name}: train one with `moaspec train` and pass --drafter")
    drafter = load_drafter(path, loaded)
    key = machine_key(loaded, path, drafter)
    output = Path(args.output) if args.output else costs_file(key).with_suffix("").with_suffix("")
    print(f"moaspec tune: {ROUNDS} rounds of every forward size, then decoding by cost beside plain decoding on "
          f"{len(questions)} prompts × {args.max_new_tokens} tokens ({key['device']}, {key['threads'] or 'GPU'} "
          f"threads); run in {output}", file=sys.stderr)
    costs, summary = tune(loaded, drafter, questions, args.max_new_tokens, output, progress=not args.no_progress)
    print(report(summary, costs))
    if args.no_save:
        return 0
    saved = save_costs(key, costs, "moaspec tune")
    print(f"saved to {saved}: `moaspec generate`, `serve` and moaspec.load() decide by these costs for this target, "
          "drafter, device and thread count (and keep refreshing them as they decode)")
    return 0
