"""How long the MoA drafter takes in a long prompt, beside the target's prefill of it, in one run.

After the target reads the prompt, the drafter's first pass runs Layer Self-Attention over
every prompt token (``begin``) and its Self-Attention catches up on them at the first draft
(``propose``). The default target and the shipped drafter (or ``--drafter``), a prompt of random token ids, each figure the
faster of two runs:

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/drafter_first_pass.py --tokens 3000 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from moaspec.decoding import SamplingParams
from moaspec.drafters import load_drafter
from moaspec.drafters.proposers import proposer_for
from specbench_script import target_and_drafter_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", default=None, help="MoA drafter checkpoint directory (default: the shipped one)")
    args = ap.parse_args()
    target, path = target_and_drafter_path(args)
    drafter = load_drafter(path, target)
    ids = torch.randint(0, target.cfg.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    best = {"prefill": float("inf"), "begin": float("inf"), "propose": float("inf")}
    with torch.inference_mode():
        for _ in range(2):
            cache = target.model.new_cache(args.tokens + 16)
            t0 = time.perf_counter()
            out = target.model(ids, cache)
            t1 = time.perf_counter()
            proposer = proposer_for(drafter)
            proposer.begin(cache, out.hidden[0])
            t2 = time.perf_counter()
            proposer.propose(ids[0].tolist() + [int(out.logits[0, -1].argmax())], 2, SamplingParams(), None)
            t3 = time.perf_counter()
            for name, s in (("prefill", t1 - t0), ("begin", t2 - t1), ("propose", t3 - t2)):
                best[name] = min(best[name], s)
    first_pass = best["begin"] + best["propose"]
    print(f"{args.tokens} prompt tokens, {args.threads} threads: target prefill {best['prefill']:.2f} s; drafter "
          f"LSA {best['begin']:.2f} s + Self-Attention catching up {best['propose']:.2f} s = {first_pass:.2f} s "
          f"({first_pass / best['prefill']:.1%} of the prefill)")


if __name__ == "__main__":
    main()
