"""Tune speculative decoding for this machine: chain length, tree shape, draft vocabulary, prompt lookup.

Every configuration and vanilla decoding run back to back on each prompt (order
rotating per prompt), greedy, first turns of SpecBench; prints tokens/s, speedup
against vanilla in the same run, and τ for each configuration. ``--grid drafter``
sweeps the drafter alone (chains, trees, draft vocabularies); ``--grid vocab`` the
default decodings at smaller draft vocabularies; ``--grid lookup``
sweeps prompt lookup's length alone, before chains of the drafter, and grafted onto
its smallest tree; ``--grid ngram`` the shortest lookup match that counts; ``--grid
confidence`` longer chains cut where the drafter's probability falls below a threshold;
``--grid dtype`` the default decodings with the drafter in its drafting dtype, with int8 weights and in fp32;
``--grid small`` the smallest chains and trees, alone and after lookup.

    .venv/bin/python benchmarks/sweep.py --grid drafter --per-file 2 --max-new-tokens 128
"""

from __future__ import annotations

import torch

import specbench_script  # beside this script
from moaspec.chat import chat_messages, encode_chat
from moaspec.decoding import GenerationConfig
from moaspec.decoding.tree import TreeShape
from moaspec.drafters import load_drafter
from moaspec.drafters.base import Drafter
from moaspec.models import LoadedModel
from moaspec.strategy import Strategy

CHAINS = [1, 2, 3, 4, 6]
TREES = [TreeShape(2, 2, 3), TreeShape(2, 2, 4), TreeShape(3, 2, 6), TreeShape(3, 2, 8), TreeShape(3, 3, 10), TreeShape(4, 3, 12),
         TreeShape(5, 4, 24)]
VOCABS = [4096]
LOOKUPS = [5, 10, 16]
LOOKUP_CHAINS = [1, 2, 3]


def drafter_grid(full: Drafter, vocabs: dict[int, Drafter]) -> dict[str, Strategy]:
    grid = {f"chain-{t}": Strategy(full, chain=t) for t in CHAINS}
    grid.update({f"tree-{s.depth}x{s.top_k}-{s.total}": Strategy(full, tree=s) for s in TREES})
    for k, d in vocabs.items():
        grid[f"tree-3x2-8-v{k}"] = Strategy(d, tree=TreeShape(3, 2, 8))
        grid[f"chain-2-v{k}"] = Strategy(d, chain=2)
    return grid


def lookup_grid(full: Drafter) -> dict[str, Strategy]:
    grid = {"chain-2": Strategy(full, chain=2)}
    for n in LOOKUPS:
        grid[f"lookup-{n}"] = Strategy(lookup=n)
        grid.update({f"lookup-{n}+chain-{c}": Strategy(full, chain=c, lookup=n) for c in LOOKUP_CHAINS})
    grid["lookup-10+tree-2x2-4"] = Strategy(full, tree=TreeShape(2, 2, 4), lookup=10)
    return grid


def ngram_grid(full: Drafter) -> dict[str, Strategy]:
    """How long a lookup match must be before it takes a cycle from the drafter (chains) or joins its tree."""
    grid = {}
    for m in (1, 2, 3):
        grid[f"lookup-10+chain-2-min{m}"] = Strategy(full, chain=2, lookup=10, lookup_min_ngram=m)
    for m in (1, 2):
        grid[f"lookup-10+tree-2x2-4-min{m}"] = Strategy(full, tree=TreeShape(2, 2, 4), lookup=10, lookup_min_ngram=m)
    return grid


def confidence_grid(full: Drafter) -> dict[str, Strategy]:
    """Longer chains that end where the drafter's probability falls below a threshold, alone and after lookup."""
    grid = {"chain-2": Strategy(full, chain=2), "lookup-10+chain-2": Strategy(full, chain=2, lookup=10)}
    for chain, p in ((4, 0.5), (6, 0.5), (6, 0.6), (6, 0.7)):
        grid[f"chain-{chain}-p{p}"] = Strategy(full, chain=chain, confidence=p)
    grid["lookup-10+chain-6-p0.6"] = Strategy(full, chain=6, lookup=10, confidence=0.6)
    return grid


def vocab_grid(vocabs: dict[int, Drafter]) -> dict[str, Strategy]:
    """The default decodings (chains of 2, the smallest tree, lookup before chains of 2) at each draft vocabulary."""
    grid = {}
    for k, d in vocabs.items():
        grid[f"chain-2-v{k}"] = Strategy(d, chain=2)
        grid[f"tree-2x2-4-v{k}"] = Strategy(d, tree=TreeShape(2, 2, 4))
        grid[f"lookup-10+chain-2-v{k}"] = Strategy(d, chain=2, lookup=10)
    return grid


def dtype_grid(drafters: list[Drafter]) -> dict[str, Strategy]:
    """The default decodings (chains of 2, the smallest tree, lookup before chains of 2) once per drafter copy,
    labelled by the dtype it drafts in."""
    grid = {}
    for d in drafters:
        dtype = d.precision
        grid[f"chain-2-{dtype}"] = Strategy(d, chain=2)
        grid[f"tree-2x2-4-{dtype}"] = Strategy(d, tree=TreeShape(2, 2, 4))
        grid[f"lookup-10+chain-2-{dtype}"] = Strategy(d, chain=2, lookup=10)
    return grid


def small_grid(full: Drafter) -> dict[str, Strategy]:
    """The smallest chains and trees, alone and after lookup: 2- to 4-token verifications, where the kernel a
    product runs on changes on some CPUs (3 rows on MKL, 4 packed on the Intel Xeon of BENCHMARKS.md)."""
    grid: dict[str, Strategy] = {}
    for lookup in (0, 10):
        prefix = f"lookup-{lookup}+" if lookup else ""
        grid.update({f"{prefix}chain-{c}": Strategy(full, chain=c, lookup=lookup) for c in (1, 2)})
        grid.update({f"{prefix}tree-2x2-{t}": Strategy(full, tree=TreeShape(2, 2, t), lookup=lookup) for t in (3, 4)})
    return grid


GRIDS = {"lookup": lookup_grid, "ngram": ngram_grid, "confidence": confidence_grid, "small": small_grid}  # grids of the full drafter alone
VOCAB_SIZES = [4096, 2048]


def smaller_vocabularies(path: str, lm: LoadedModel, full: Drafter, sizes: list[int]) -> dict[int, Drafter]:
    """A copy of the drafter per size, its logits restricted to that many of its trained draft vocabulary."""
    vocabs = {k: load_drafter(path, lm) for k in sizes if full.draft_vocab is not None and k < full.cfg.draft_vocab_size}
    for k, d in vocabs.items():
        d.attach(lm.model, vocab_limit=k)
    return vocabs


def main() -> None:
    ap = specbench_script.parser(__doc__, per_file=2)
    ap.add_argument("--grid", choices=("drafter", "vocab", "dtype", *GRIDS), default="drafter")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    lm, path = specbench_script.target_and_drafter_path(args)
    full = load_drafter(path, lm)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    if args.grid == "drafter":
        configs = {"vanilla": Strategy(), **drafter_grid(full, smaller_vocabularies(path, lm, full, VOCABS))}
    elif args.grid == "vocab":
        vocabs = {full.cfg.draft_vocab_size: full, **smaller_vocabularies(path, lm, full, VOCAB_SIZES)}
        configs = {"vanilla": Strategy(), **vocab_grid(vocabs)}
    elif args.grid == "dtype":
        # each precision as it names itself, whatever this CPU's default is
        drafters = [load_drafter(path, lm, torch.bfloat16).use_int8(), load_drafter(path, lm, torch.bfloat16),
                    load_drafter(path, lm, torch.float32)]
        configs = {"vanilla": Strategy(), **dtype_grid(drafters)}
    else:
        configs = {"vanilla": Strategy(), **GRIDS[args.grid](full)}

    prompts = [encode_chat(lm.tokenizer, chat_messages(q.turns[0]))
               for q in specbench_script.questions(args)]
    names = list(configs)
    for n in names:  # warm-up
        configs[n].run(lm, prompts[0][:32], cfg)
    stats = {n: {"tokens": 0, "s": 0.0, "accepted": 0, "calls": 0} for n in names}
    for i, ids in enumerate(prompts):
        for n in names[i % len(names):] + names[: i % len(names)]:
            r = configs[n].run(lm, ids, cfg)
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
    specbench_script.write_results(args, results=rows)


if __name__ == "__main__":
    main()
