"""``moaspec bench``: compare decoding methods on SpecBench-format questions."""

from __future__ import annotations

import argparse

from moaspec.cli import options


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    b = sub.add_parser("bench", help="compare decoding methods on SpecBench-format questions (tokens/s, speedup, tau, mismatches)")
    b.add_argument("--questions", required=True, help="a SpecBench-format .jsonl file or a directory of them")
    b.add_argument("--methods", default="vanilla,moa,hf",
                   help="comma list from vanilla, default, moa, moa-cost, moa-chain, moa-pld, moa-chain-pld, pld, eagle2, independent, hf, hf-pld, hf-assisted")
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--limit", type=int, default=None, help="the first K questions of each file")
    b.add_argument("--output", required=True, help="directory for answers.jsonl, summary.json and plots")
    b.add_argument("--drafter", default=None, help="MoA drafter (default: the shipped one)")
    b.add_argument("--eagle-drafter", default=None, help="EAGLE drafter for eagle2 (default: the one shipped for the target)")
    b.add_argument("--independent-drafter", default=None, help="independent drafter for independent and hf-assisted")
    b.add_argument("--chain", type=int, default=options.default_chain(),
                   help="drafts per target forward for moa-chain, moa-chain-pld and independent")
    options.add_confidence_option(b)
    b.add_argument("--lookup", type=int, default=options.default_lookup(),
                   help="prompt lookup drafts per target forward for pld, moa-pld, moa-chain-pld and hf-pld")
    options.add_tree_options(b)
    options.add_sampling_options(b, "seed for sampling (default 0); each prompt gets its own seed derived from it "
                                    "and the prompt, the same for every method, so a run repeats exactly")
    b.add_argument("--no-progress", action="store_true")
    options.add_model_options(b)
    options.add_drafter_dtype_option(b)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moaspec.bench.methods import MethodOptions, build_methods
    from moaspec.bench.run import run_bench, table
    from moaspec.decoding import SamplingParams
    from moaspec.specbench import check_first_turns_fit, load_questions

    names = options.method_list(args.methods)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, 0 if args.seed is None else args.seed)
    options.require(args, ">= 1", options.at_least(1), "max_new_tokens", "limit", "chain", "lookup")
    questions = load_questions(args.questions, per_file=args.limit)
    loaded = options.load_target(args)
    check_first_turns_fit(questions, loaded.tokenizer, loaded.cfg.max_position_embeddings)
    opts = MethodOptions(moa_drafter=args.drafter, eagle_drafter=args.eagle_drafter,
                         independent_drafter=args.independent_drafter, chain=args.chain, confidence=args.draft_confidence,
                         pld_tokens=args.lookup, sampling=sampling,
                         tree=options.tree_knobs(args))
    methods = build_methods(names, loaded, opts)
    summary = run_bench(loaded, questions, methods, args.max_new_tokens, Path(args.output), progress=not args.no_progress,
                        settings=options.bench_settings(args, loaded), greedy=sampling.greedy)
    print(table(summary))
    print(f"answers, summary.json and plots in {args.output}")
    return 0
