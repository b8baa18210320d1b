"""Tune speculative decoding for this machine: chain length, tree shape and draft-vocabulary size.

Every configuration and vanilla decoding run back to back on each prompt (order
rotating per prompt), greedy, first turns of SpecBench; prints tokens/s, speedup
against vanilla in the same run, and τ for each configuration.

    .venv/bin/python benchmarks/sweep.py --per-file 2 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moaspec.chat import chat_messages, encode_chat
from moaspec.decoding import GenerationConfig, generate
from moaspec.decoding.speculative import generate_chain
from moaspec.decoding.tree import TreeShape, generate_tree
from moaspec.drafters import load_drafter, shipped_drafter
from moaspec.drafters.proposers import MoAProposer
from moaspec.models import load_model
from moaspec.specbench import load_questions

REPO = Path(__file__).resolve().parent.parent
CHAINS = [1, 2, 3, 4, 6]
TREES = [TreeShape(2, 2, 4), TreeShape(3, 2, 8), TreeShape(4, 3, 12), TreeShape(5, 4, 24)]
VOCABS = [4096]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", default=str(REPO.parent / "shared" / "specbench"))
    ap.add_argument("--per-file", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(None, device="cpu")
    path = args.drafter or shipped_drafter(lm)
    full = load_drafter(path, lm)
    vocabs = {k: load_drafter(path, lm) for k in VOCABS if full.draft_vocab is not None and k < full.cfg.draft_vocab_size}
    for k, d in vocabs.items():
        d.attach(lm.model, vocab_limit=k)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    m, tok = lm.model, lm.tokenizer

    configs: dict[str, object] = {"vanilla": lambda ids: generate(m, tok, ids, cfg)}
    for t in CHAINS:
        configs[f"chain-{t}"] = lambda ids, t=t: generate_chain(m, tok, MoAProposer(full), ids, cfg, t)
    for s in TREES:
        configs[f"tree-{s.depth}x{s.top_k}-{s.total}"] = lambda ids, s=s: generate_tree(m, tok, MoAProposer(full), ids, cfg, s)
    for k, d in vocabs.items():
        configs[f"tree-3x2-8-v{k}"] = lambda ids, d=d: generate_tree(m, tok, MoAProposer(d), ids, cfg, TreeShape(3, 2, 8))
        configs[f"chain-2-v{k}"] = lambda ids, d=d: generate_chain(m, tok, MoAProposer(d), ids, cfg, 2)

    prompts = [encode_chat(tok, chat_messages(q.turns[0])) for q in load_questions(args.questions, per_file=args.per_file)]
    names = list(configs)
    for n in names:  # warm-up
        configs[n](prompts[0][:32])
    stats = {n: {"tokens": 0, "s": 0.0, "accepted": 0, "calls": 0} for n in names}
    for i, ids in enumerate(prompts):
        for n in names[i % len(names):] + names[: i % len(names)]:
            r = configs[n](ids)
            st = stats[n]
            st["tokens"] += r.new_tokens
            st["s"] += r.total_s
            st["accepted"] += sum(r.accepted_lengths)
            st["calls"] += len(r.accepted_lengths)
        print(f"prompt {i + 1}/{len(prompts)}", flush=True)
    base = stats["vanilla"]["tokens"] / stats["vanilla"]["s"]
    print(f"\n{'config':<22}{'tok/s':>8}{'speedup':>9}{'tau':>7}")
    rows = {}
    for n in names:
        st = stats[n]
        tps = st["tokens"] / st["s"]
        tau = st["accepted"] / st["calls"] if st["calls"] else 1.0
        rows[n] = {"tokens_per_s": round(tps, 2), "speedup": round(tps / base, 3), "tau": round(tau, 3)}
        print(f"{n:<22}{tps:>8.1f}{tps / base:>9.2f}{tau:>7.2f}")
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "results": rows}, indent=1))


if __name__ == "__main__":
    main()
