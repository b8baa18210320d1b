"""Chain acceptance length τ of a drafter (any kind) on SpecBench, per category, with vanilla decoding interleaved.

Greedy, first turns, chains of ``--draft-len`` drafts. For every prompt the chain
run and a vanilla run go back to back (alternating order), so tokens/s are compared
under the same machine noise, and every chain output is checked token for token
against vanilla's (losslessness on the real model).

    .venv/bin/python benchmarks/chain_tau.py --questions ../shared/specbench --per-file 10 --max-new-tokens 128
"""

from __future__ import annotations

from collections import defaultdict

from moaspec.chat import chat_messages, encode_chat
from moaspec.decoding import GenerationConfig, generate
from moaspec.decoding.speculative import generate_chain
from moaspec.drafters import load_drafter
from moaspec.drafters.proposers import proposer_for
from moaspec.specbench import load_questions

import specbench_script  # beside this script


def main() -> None:
    ap = specbench_script.parser(__doc__, per_file=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-len", type=int, default=6)
    ap.add_argument("--no-vanilla", action="store_true",
                    help="τ only: skip the interleaved vanilla runs (no speedup, no losslessness check), half the time")
    args = ap.parse_args()
    lm, path = specbench_script.target_and_drafter_path(args)
    drafter = load_drafter(path, lm)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    questions = load_questions(args.questions, per_file=args.per_file)
    prompts = [(q, encode_chat(lm.tokenizer, chat_messages(q.turns[0]))) for q in questions]
    generate_chain(lm.model, lm.tokenizer, proposer_for(drafter), prompts[0][1], GenerationConfig(max_new_tokens=16))
    generate(lm.model, lm.tokenizer, prompts[0][1], GenerationConfig(max_new_tokens=16))

    rows = []
    for i, (q, ids) in enumerate(prompts):
        out = {}
        order = ("spec",) if args.no_vanilla else ("spec", "vanilla") if i % 2 == 0 else ("vanilla", "spec")
        for which in order:
            if which == "spec":
                out["spec"] = generate_chain(lm.model, lm.tokenizer, proposer_for(drafter), ids, cfg, draft_len=args.draft_len)
            else:
                out["vanilla"] = generate(lm.model, lm.tokenizer, ids, cfg)
        m, v = out["spec"], out.get("vanilla", out["spec"])
        rows.append({"category": q.category, "question": q.question_id, "tau": m.tau, "calls": m.target_calls,
                     "tokens": m.new_tokens, "spec_s": m.total_s, "vanilla_s": v.total_s, "draft_s": m.draft_s,
                     "identical": None if args.no_vanilla else m.token_ids == v.token_ids, "accepted": m.accepted_lengths})
        print(f"{q.category:<11}{q.question_id:>6}  tau {m.tau:5.2f}  drafted {m.tokens_per_s:6.1f} tok/s  "
              f"vanilla {v.tokens_per_s:6.1f}  {({True: 'same', False: 'MISMATCH', None: ''})[rows[-1]['identical']]}",
              flush=True)

    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[r["category"]].append(r)
    groups["overall"] = rows
    summary = {}
    print(f"\n{'category':<11}{'tau':>6}{'spec tok/s':>11}{'vanilla':>9}{'speedup':>9}{'mismatch':>10}")
    for name, rs in groups.items():
        accepted = [a for r in rs for a in r["accepted"]]
        tau = sum(accepted) / len(accepted)
        spec = sum(r["tokens"] for r in rs) / sum(r["spec_s"] for r in rs)
        bad = sum(r["identical"] is False for r in rs)
        summary[name] = {"tau": round(tau, 3), "spec_tokens_per_s": round(spec, 2), "prompts": len(rs)}
        if args.no_vanilla:
            print(f"{name:<11}{tau:>6.2f}{spec:>11.1f}{'-':>9}{'-':>9}{'-':>10}")
            continue
        van = sum(r["tokens"] for r in rs) / sum(r["vanilla_s"] for r in rs)
        summary[name].update({"vanilla_tokens_per_s": round(van, 2), "speedup": round(spec / van, 3), "greedy_mismatches": bad})
        print(f"{name:<11}{tau:>6.2f}{spec:>11.1f}{van:>9.1f}{spec / van:>9.2f}{bad:>10}")
    specbench_script.write_results(args, summary=summary, rows=rows)


if __name__ == "__main__":
    main()
