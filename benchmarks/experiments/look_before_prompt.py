"""The default with and without its rule against looks at the drafter before it has read a long prompt, in one run.

A look at a drafter not expected to pay (taken now and then, since acceptance moves) first has it read every token it
has not read, the whole prompt the first time. The default takes no such look while more than
``moaspec.decoding.policy.EXPLORE_UNREAD`` tokens are unread. This runs plain decoding, the default, and the default
without that rule (the bound lifted), each arm with its own policy (the same measured costs), every SpecBench first turn
through every arm back to back, the order reversed every other prompt, and writes each prompt's tokens/s per arm
(prefill included) with its prompt length:

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/look_before_prompt.py --per-file 10 \\
        --max-new-tokens 128 --threads 2 --out bench-out/look-before-prompt.json
"""

from __future__ import annotations

import json
from typing import Any

import specbench_script
from moaspec.api import decoding_strategy
from moaspec.chat import chat_messages, encode_chat
from moaspec.decoding import policy
from moaspec.decoding.generation import GenerationConfig
from moaspec.strategy import Strategy


def own_policy(strategy: Strategy) -> Strategy:
    """``strategy`` with a policy of its own (the same costs as loaded), so that arms do not share what they learn."""
    assert strategy.policy is not None
    shared = strategy.policy
    return Strategy(strategy.drafter, chain=strategy.chain, lookup=strategy.lookup, confidence=strategy.confidence,
                    policy=policy.Policy(shared.costs.copy(), source=shared.source))


def main() -> None:
    ap = specbench_script.parser(__doc__, per_file=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    lm, drafter = specbench_script.target_and_drafter_path(args)
    prompts = [(q.category, encode_chat(lm.tokenizer, chat_messages(q.turns[0]))) for q in specbench_script.questions(args)]
    default = decoding_strategy(lm, drafter)
    arms = {"plain": decoding_strategy(lm, None), "default": own_policy(default), "no-rule": own_policy(default)}
    bound = policy.EXPLORE_UNREAD

    def run(name: str, ids: list[int], most: int) -> Any:
        policy.EXPLORE_UNREAD = 10**9 if name == "no-rule" else bound
        return arms[name].run(lm, ids, GenerationConfig(max_new_tokens=most))

    for name in arms:  # warm-up
        run(name, prompts[0][1], 16)
    rows = []
    for i, (category, ids) in enumerate(prompts):
        row: dict[str, Any] = {"category": category, "prompt_tokens": len(ids)}
        for name in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
            r = run(name, ids, args.max_new_tokens)
            row[name] = len(r.token_ids) / r.total_s
        rows.append(row)
        print(i, category, len(ids), " ".join(f"{n} {row[n]:.1f}" for n in arms), flush=True)
    policy.EXPLORE_UNREAD = bound
    with open(args.out, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main()
