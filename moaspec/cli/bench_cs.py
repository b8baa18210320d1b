"""``moaspec bench-cs``: client–server decoding under emulated links, and after a disconnection."""

from __future__ import annotations

import argparse

from moaspec.cli import options
from moaspec.errors import MoaspecError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bc = sub.add_parser("bench-cs", help="client–server decoding under emulated 4G/5G/LAN links, and after a disconnection")
    bc.add_argument("--questions", required=True, help="a SpecBench-format .jsonl file or a directory of them")
    bc.add_argument("--limit", type=int, default=None, help="the first K questions of each file")
    bc.add_argument("--profiles", default="lan,4g,5g", help="comma list from lan, 4g, 5g, none (default lan,4g,5g)")
    bc.add_argument("--methods", default="moa,api",
                    help="comma list from moa, moa-pld (prompt lookup first), moa-tree (dynamic trees), eagle2, independent, api")
    bc.add_argument("--lookup", type=int, default=options.default_lookup(), metavar="N",
                    help=f"prompt lookup drafts per verification for moa-pld (default {options.default_lookup()})")
    bc.add_argument("--eagle-drafter", default=None, help="EAGLE drafter for eagle2 (`moaspec train --kind eagle`; default: the one shipped for the target)")
    bc.add_argument("--independent-drafter", default=None,
                    help="independent drafter for independent (`moaspec train --kind independent`)")
    bc.add_argument("--output", required=True, help="directory for summary.json")
    bc.add_argument("--max-new-tokens", type=int, default=128)
    bc.add_argument("--drafter", default=None, help="MoA drafter (default: the shipped one)")
    bc.add_argument("--chain", type=int, default=options.default_chain(),
                    help=f"drafts per verification (default {options.default_chain()})")
    options.add_confidence_option(bc)
    options.add_tree_options(bc)
    bc.add_argument("--state-format", choices=("fp16", "int8"), default="fp16")
    bc.add_argument("--disconnect-after", type=int, default=32, help="cut the link after K verified tokens (0: no study)")
    bc.add_argument("--disconnect-drafters", default="", metavar="DIR[,DIR]",
                    help="more MoA drafters (one per N, e.g. --tli-layers 1) for the disconnection study")
    bc.add_argument("--continue-tokens", type=int, default=128, help="tokens the client generates alone after the cut")
    bc.add_argument("--temperature", type=float, default=0.0,
                    help="0 = greedy (default); > 0: every method samples (the disconnection study stays greedy)")
    bc.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    bc.add_argument("--seed", type=int, default=None,
                    help="seed for sampling (default 0); each prompt's is derived from it, the same for every method")
    bc.add_argument("--port", type=int, default=8790, help="port for the server this command starts")
    bc.add_argument("--no-progress", action="store_true")
    options.add_model_options(bc)
    options.add_drafter_dtype_option(bc)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moaspec.bench.methods import require_drafter
    from moaspec.clientserver.bench import run_bench_cs, table
    from moaspec.clientserver.netem import PROFILES
    from moaspec.decoding import SamplingParams
    from moaspec.drafters import shipped_drafter
    from moaspec.drafters.base import Drafter
    from moaspec.drafters.eagle import EagleDrafter
    from moaspec.drafters.independent import IndependentDrafter
    from moaspec.drafters.moa import MoADrafter
    from moaspec.specbench import check_first_turns_fit, load_questions

    names = [p.strip() for p in args.profiles.split(",") if p.strip()]
    bad = [p for p in names if p not in PROFILES]
    if not names or bad:
        raise MoaspecError(f"--profiles takes a comma list from {', '.join(PROFILES)}" + (f"; not {', '.join(bad)}" if bad else ""))
    methods = options.method_list(args.methods)
    options.require(args, ">= 1", options.at_least(1), "max_new_tokens", "chain", "lookup", "continue_tokens")
    options.require(args, ">= 0", options.at_least(0), "disconnect_after")
    if not 1 <= args.port <= 65535:
        raise MoaspecError(f"--port must be in 1..65535, got {args.port}")
    from moaspec.serving import listen

    listen("127.0.0.1", args.port).close()  # a taken port, before any loading or writing (its server starts last)
    sampling = SamplingParams(args.temperature, top_p=args.top_p, seed=0 if args.seed is None else args.seed)
    questions = load_questions(args.questions, per_file=args.limit)
    loaded = options.load_target(args)
    check_first_turns_fit(questions, loaded.tokenizer, loaded.cfg.max_position_embeddings)
    path = args.drafter or shipped_drafter(loaded)
    if path is None:
        raise MoaspecError(f"no drafter ships for {loaded.path.name}: pass --drafter")
    moa = require_drafter(str(path), MoADrafter, "moa", loaded)
    drafters: dict[str, Drafter] = {"moa": moa}
    more = [(p, require_drafter(p, MoADrafter, "the disconnection study", loaded))
            for p in (p.strip() for p in args.disconnect_drafters.split(",")) if p]
    depths = [d.cfg.tli_layers for d in ([moa] if "moa" in methods else []) + [d for _, d in more]]
    if len(set(depths)) < len(depths):
        raise MoaspecError(f"--disconnect-drafters: one MoA drafter per N (Target Layer Inference depth); got N = {depths}")
    for method, where, kind in (("eagle2", args.eagle_drafter, EagleDrafter),
                                ("independent", args.independent_drafter, IndependentDrafter)):
        if method in methods:
            drafters[method] = require_drafter(where, kind, method, loaded)
    summary = run_bench_cs(loaded, drafters, questions, [PROFILES[p] for p in names], methods, args.max_new_tokens,
                           Path(args.output), chain=args.chain, confidence=args.draft_confidence, lookup=args.lookup,
                           fmt=args.state_format,
                           tree=options.tree_knobs(args),
                           disconnect_after=args.disconnect_after,
                           continue_tokens=args.continue_tokens, port=args.port,
                           model_spec=args.model, drafter_path=str(path), more_moa=more, progress=not args.no_progress,
                           settings=options.bench_settings(args, loaded, "port"), sampling=sampling)
    print(table(summary))
    print(f"summary.json in {args.output}")
    return 0
