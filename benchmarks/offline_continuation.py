"""How well a MoA drafter writes alone after the target goes away (a client that lost its server), on one device.

For each SpecBench first turn: the target answers K tokens greedily (verified: the
drafter's memory holds them); then the drafter alone drafts C more tokens in chains
of 8, as ``moaspec client`` does while the server is unreachable, its memory frozen.
The continuation is scored by its perplexity under the target and by how many of its
first tokens equal the target's own greedy continuation. Every variant runs on the same
prompts and cut points, so they compare directly; ``--reach`` compares Cross-Attention
reaches of one drafter (``none``: queries keep their own positions however far they
stand from the memory).

    .venv/bin/python benchmarks/offline_continuation.py --per-file 10 --reach none,15 --threads 1
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import torch

import specbench_script  # beside this script
from moaspec.chat import chat_messages, encode_chat
from moaspec.clientserver.bench import perplexity
from moaspec.decoding import GenerationConfig
from moaspec.decoding.prefill import common_prefix
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.vanilla import generate
from moaspec.drafters import load_drafter
from moaspec.drafters.moa import MoADrafter
from moaspec.drafters.proposers import proposer_for
from moaspec.models import LoadedModel

NO_REACH = 1 << 30


def continue_alone(lm: LoadedModel, drafter: MoADrafter, context: list[int], tokens: int, chain: int = 8) -> list[int]:
    """``tokens`` greedy drafts after ``context`` (all verified), the drafter feeding itself in chains of ``chain``."""
    cache = lm.model.new_cache(len(context) + tokens + chain)
    with torch.inference_mode():
        out = lm.model(torch.tensor([context[:-1]]), cache)  # the newest token has no K/V yet, as after a verification
    proposer = proposer_for(drafter)
    proposer.begin(cache, out.hidden[0])
    ids = list(context)
    while len(ids) - len(context) < tokens:
        ids += proposer.propose(ids, min(chain, tokens - (len(ids) - len(context))), SamplingParams(), None).tokens.tolist()
    return ids[len(context):]


def main() -> None:
    ap = specbench_script.parser(__doc__, per_file=10)
    ap.add_argument("--verified", type=int, default=32, help="tokens the target answers before the cut (K)")
    ap.add_argument("--continue-tokens", type=int, default=128, help="tokens the drafter writes alone (C)")
    ap.add_argument("--reach", default="", help="Cross-Attention reaches to compare, e.g. none,15 (default: the drafter's own)")
    args = ap.parse_args()
    lm, path = specbench_script.target_and_drafter_path(args)
    variants: dict[str, MoADrafter] = {}
    for r in [r.strip() for r in args.reach.split(",") if r.strip()] or ["own"]:
        d = load_drafter(path, lm)
        if not isinstance(d, MoADrafter):
            raise SystemExit(f"{path} is not a MoA drafter")
        if r != "own":
            d.cfg = replace(d.cfg, ca_reach=NO_REACH if r == "none" else int(r))
        variants[r] = d
    per: list[dict[str, object]] = []
    for q in specbench_script.questions(args):
        prompt = encode_chat(lm.tokenizer, chat_messages(q.turns[0]))
        cfg = GenerationConfig(max_new_tokens=args.verified, ignore_eos=True)
        context = prompt + generate(lm.model, lm.tokenizer, prompt, cfg).token_ids
        cfg = GenerationConfig(max_new_tokens=args.continue_tokens, ignore_eos=True)
        reference = generate(lm.model, lm.tokenizer, context, cfg).token_ids
        row: dict[str, object] = {"category": q.category, "question_id": q.question_id}
        for name, d in variants.items():
            alone = continue_alone(lm, d, context, args.continue_tokens)
            row[name] = {"perplexity": round(perplexity(lm, context, alone), 4), "exact_match": common_prefix(alone, reference)}
        per.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'variant':<10}{'geo-mean perplexity':>21}{'exact match':>13}")
    summary = {}
    for name in variants:
        ppl = math.exp(sum(math.log(r[name]["perplexity"]) for r in per) / len(per))  # type: ignore[index]
        match = sum(r[name]["exact_match"] for r in per) / len(per)  # type: ignore[index]
        summary[name] = {"geo_mean_perplexity": round(ppl, 3), "exact_match": round(match, 2)}
        print(f"{name:<10}{ppl:>21.2f}{match:>13.1f}")
    names = list(variants)
    for other in names[1:]:
        better = sum(1 for r in per if r[other]["perplexity"] < 0.99 * r[names[0]]["perplexity"])  # type: ignore[index]
        worse = sum(1 for r in per if r[other]["perplexity"] > 1.01 * r[names[0]]["perplexity"])  # type: ignore[index]
        print(f"{other} against {names[0]}: lower perplexity on {better} prompts, higher on {worse}, "
              f"within 1% on {len(per) - better - worse}")
    specbench_script.write_results(args, summary=summary, prompts=per)


if __name__ == "__main__":
    main()
