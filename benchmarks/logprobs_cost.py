"""What asking for log-probabilities costs: the default decoding with and without them, interleaved in one run.

Same target, drafter and prompts (the first turn of the first K questions of every
SpecBench file), greedy. Per prompt the settings run back to back in alternating
order, so machine noise hits all alike; the figures are ratios. Also checks that the
text is the same either way.

    .venv/bin/python benchmarks/logprobs_cost.py --per-file 2 --top 0,5,20
"""

from __future__ import annotations

import torch

import moaspec
from moaspec.chat import chat_messages
from specbench_script import parser, questions, write_results


def main() -> None:
    ap = parser(__doc__, per_file=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--top", default="0,5,20", help="alternatives per token to compare with none (comma list)")
    args = ap.parse_args()

    lm = moaspec.load(drafter=args.drafter or "shipped", threads=args.threads)
    settings: list[int | None] = [None, *(int(k) for k in args.top.split(","))]
    prompts = [chat_messages(q.turns[0]) for q in questions(args)]
    lm.generate(prompts[0], max_new_tokens=16)  # warm-up
    seconds = {k: 0.0 for k in settings}
    tokens = {k: 0 for k in settings}
    for i, prompt in enumerate(prompts):
        order = settings if i % 2 == 0 else settings[::-1]
        texts = set()
        for k in order:
            with torch.inference_mode():
                out = lm.generate(prompt, max_new_tokens=args.max_new_tokens, logprobs=k)
            seconds[k] += out.total_s
            tokens[k] += out.new_tokens
            texts.add(out.text)
        if len(texts) != 1:
            raise SystemExit(f"prompt {i}: the text differs with log-probabilities")
    base = tokens[None] / seconds[None]
    rows = {("none" if k is None else f"top {k}"): {"tokens_per_s": round(tokens[k] / seconds[k], 2),
                                                    "vs_none": round(tokens[k] / seconds[k] / base, 3)} for k in settings}
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, {lm.strategy.describe()}, {args.threads} threads")
    for name, row in rows.items():
        print(f"  logprobs {name:>7}: {row['tokens_per_s']:7.2f} tok/s  ({row['vs_none']:.3f}x none)")
    write_results(args, prompts=len(prompts), decoding=lm.strategy.describe(), settings=rows)


if __name__ == "__main__":
    main()
