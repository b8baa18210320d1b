"""Does speculation still pay under presence/frequency penalties? Speedups with and without them, in one run.

Penalties change the text, so each speedup is against plain decoding with the same
settings. Same target, drafter and prompts (the first turn of the first K questions of
every SpecBench file), greedy; per prompt the four runs go back to back in alternating
order, so machine noise hits all alike. Checks that each speculative answer equals plain
decoding's under the same settings.

    .venv/bin/python benchmarks/penalties_speedup.py --per-file 2 --presence 0.5 --frequency 0.5
"""

from __future__ import annotations

import torch

import moaspec
from moaspec.chat import chat_messages
from specbench_script import add_penalty_arguments, parser, questions, write_results


def main() -> None:
    ap = parser(__doc__, per_file=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    add_penalty_arguments(ap)
    args = ap.parse_args()

    lm = moaspec.load(drafter=args.drafter or "shipped", threads=args.threads)
    plain = lm.with_decoding(None)
    settings = {"none": {}, "penalties": {"presence_penalty": args.presence, "frequency_penalty": args.frequency}}
    runs = [(name, model) for name in settings for model in ("plain", "speculative")]
    prompts = [chat_messages(q.turns[0]) for q in questions(args)]
    lm.generate(prompts[0], max_new_tokens=16)  # warm-up
    totals = {run: {"s": 0.0, "tokens": 0, "calls": 0, "accepted": 0} for run in runs}
    for i, prompt in enumerate(prompts):
        answers = {}
        for name, which in runs if i % 2 == 0 else runs[::-1]:
            with torch.inference_mode():
                out = (lm if which == "speculative" else plain).generate(prompt, max_new_tokens=args.max_new_tokens,
                                                                        **settings[name])
            t = totals[(name, which)]
            t["s"] += out.total_s
            t["tokens"] += out.new_tokens
            t["calls"] += len(out.accepted_lengths)
            t["accepted"] += sum(out.accepted_lengths)
            answers[(name, which)] = out.token_ids
        for name in settings:
            if answers[(name, "plain")] != answers[(name, "speculative")]:
                raise SystemExit(f"prompt {i}, {name}: the speculative answer differs from plain decoding's")
    rows = {}
    for name in settings:
        p, s = totals[(name, "plain")], totals[(name, "speculative")]
        rows[name] = {"plain_tokens_per_s": round(p["tokens"] / p["s"], 2),
                      "speculative_tokens_per_s": round(s["tokens"] / s["s"], 2),
                      "speedup": round((s["tokens"] / s["s"]) / (p["tokens"] / p["s"]), 3),
                      "tau": round(s["accepted"] / s["calls"], 3)}
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, {lm.strategy.describe()}, {args.threads} threads, "
          f"penalties: presence {args.presence}, frequency {args.frequency}")
    for name, row in rows.items():
        print(f"  {name:>9}: plain {row['plain_tokens_per_s']:6.2f} tok/s, speculative "
              f"{row['speculative_tokens_per_s']:6.2f} tok/s, speedup {row['speedup']:.3f}x, tau {row['tau']:.2f}")
    write_results(args, prompts=len(prompts), decoding=lm.strategy.describe(), settings=rows)


if __name__ == "__main__":
    main()
