"""Speculative sampling: drafts sampled from the drafter against its most likely drafts as point masses.

Both keep the target's distribution. Sampled drafts (one device's way) are accepted
with probability Σ min(p, q) per position; the drafter's most likely token, verified
as a point mass (the client–server way, where no draft distribution travels), with
p(x). Which is accepted more often depends on how close the drafter's q is to the
target's p. For every prompt and temperature both run back to back with the same seed
(alternating order); τ is compared prompt by prompt with a sign test.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/sampled_drafts.py --per-file 5 --max-new-tokens 128 --temperatures 0.7,1.0
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import specbench_script  # benchmarks/specbench_script.py (PYTHONPATH=benchmarks)
from compare_tau import sign_test  # benchmarks/compare_tau.py (PYTHONPATH=benchmarks)
from moaspec.chat import chat_messages, encode_chat
from moaspec.decoding import GenerationConfig, SamplingParams
from moaspec.decoding.proposer import Proposal, Proposer
from moaspec.decoding.speculative import generate_chain
from moaspec.drafters import load_drafter
from moaspec.drafters.proposers import proposer_for
from moaspec.models.kv_cache import KVCache


class PointMassDrafts:
    """A proposer's most likely drafts, offered as point masses even when the generation samples."""

    def __init__(self, inner: Proposer, vocab: int) -> None:
        self.inner, self.vocab = inner, vocab

    def begin(self, target_cache: KVCache, hidden: torch.Tensor) -> None:
        self.inner.begin(target_cache, hidden)

    def propose(self, tokens: Sequence[int], n: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        drafts = self.inner.propose(tokens, n, SamplingParams(), None).tokens
        point = torch.nn.functional.one_hot(drafts, self.vocab).float() if len(drafts) else None
        return Proposal(drafts, point)

    def commit(self, verified: int, path: Sequence[int] | None = None, hidden: torch.Tensor | None = None) -> None:
        self.inner.commit(verified, path, hidden)


def main() -> None:
    ap = specbench_script.parser(__doc__, per_file=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-len", type=int, default=2, help="drafts per chain (default 2, the main job's)")
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lm, path = specbench_script.target_and_drafter_path(args)
    drafter = load_drafter(path, lm)
    temps = [float(t) for t in args.temperatures.split(",")]
    questions = specbench_script.questions(args)
    prompts = [(q, encode_chat(lm.tokenizer, chat_messages(q.turns[0]))) for q in questions]
    make = {"sampled": lambda: proposer_for(drafter), "point": lambda: PointMassDrafts(proposer_for(drafter), lm.cfg.vocab_size)}
    warm = GenerationConfig(max_new_tokens=16, sampling=SamplingParams(temperature=1.0, seed=0))
    for way in make:
        generate_chain(lm.model, lm.tokenizer, make[way](), prompts[0][1], warm, draft_len=args.draft_len)

    rows = []
    for i, (q, ids) in enumerate(prompts):
        for t in temps:
            cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=SamplingParams(temperature=t, seed=args.seed + i))
            row = {"category": q.category, "question": q.question_id, "temperature": t}
            for way in (("sampled", "point") if i % 2 == 0 else ("point", "sampled")):
                r = generate_chain(lm.model, lm.tokenizer, make[way](), ids, cfg, draft_len=args.draft_len)
                row[way] = {"tau": r.tau, "tokens": r.new_tokens, "s": r.total_s, "accepted": r.accepted_lengths}
            rows.append(row)
            print(f"{q.category:<11}{q.question_id:>6}  T={t:.2f}  tau sampled {row['sampled']['tau']:5.2f}  "
                  f"point {row['point']['tau']:5.2f}", flush=True)

    summary = {}
    print(f"\n{'temperature':<13}{'tau sampled':>12}{'tau point':>11}{'tok/s sampled':>15}{'tok/s point':>13}"
          f"{'point higher/lower':>20}{'p':>8}")
    for t in temps:
        rs = [r for r in rows if r["temperature"] == t]
        out = {}
        for way in ("sampled", "point"):
            acc = [a for r in rs for a in r[way]["accepted"]]
            out[way] = {"tau": round(sum(acc) / len(acc), 3),
                        "tokens_per_s": round(sum(r[way]["tokens"] for r in rs) / sum(r[way]["s"] for r in rs), 2)}
        hi = sum(r["point"]["tau"] > r["sampled"]["tau"] for r in rs)
        lo = sum(r["point"]["tau"] < r["sampled"]["tau"] for r in rs)
        out.update({"point_higher": hi, "point_lower": lo, "sign_test_p": round(sign_test(hi, lo), 4)})
        summary[str(t)] = out
        print(f"{t:<13}{out['sampled']['tau']:>12.3f}{out['point']['tau']:>11.3f}{out['sampled']['tokens_per_s']:>15.1f}"
              f"{out['point']['tokens_per_s']:>13.1f}{f'{hi}/{lo}':>20}{out['sign_test_p']:>8.3f}")
    specbench_script.write_results(args, summary=summary, rows=rows)


if __name__ == "__main__":
    main()
