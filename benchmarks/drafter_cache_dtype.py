"""Drafters drafting in bf16 with their own K/V caches in bf16 or in fp32, interleaved in one run.

On a CPU, ``Drafter.cache_dtype`` keeps a bf16 drafter's caches (MoA's Self-Attention cache and
Cross-Attention memory, EAGLE's layer cache) in fp32, because torch's CPU attention is slow for a
single bf16 query. This measures what that buys in real decoding: per decoding method (the MoA
tree, the main job's default, EAGLE's tree), each prompt decoded with both cache dtypes back to
back in alternating order (trees without prompt lookup), greedy, first turns of SpecBench; tokens/s, drafting ms per cycle and τ.
Greedy text must be the same either way (it is the target's); the script stops if it is not. Last, the
MoA drafter drafting 128 tokens alone after each prompt, one query per step, as a client does while its
server is unreachable: drafted tokens/s with each cache dtype.

    .venv/bin/python benchmarks/drafter_cache_dtype.py --per-file 2 --max-new-tokens 128
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

import moaspec
from moaspec.chat import chat_messages, encode_chat
from moaspec.decoding import SamplingParams
from moaspec.drafters import shipped_drafter
from moaspec.drafters.base import Drafter
from moaspec.drafters.proposers import proposer_for
from specbench_script import parser, questions, write_results

CACHE_DTYPES = ("bfloat16", "float32")
ALONE = 128  # tokens the drafter drafts alone after each prompt


def drafting_alone(lm: moaspec.SpeculativeModel, prompt: list[int]) -> tuple[float, list[int]]:
    """Seconds for the drafter to draft ``ALONE`` tokens after ``prompt`` with no target forward, and the drafts."""
    model, drafter = lm.target.model, lm.strategy.drafter
    assert drafter is not None
    cache = model.new_cache(len(prompt) + ALONE + 1)
    out = model(torch.tensor([prompt]), cache)
    proposer = proposer_for(drafter)
    proposer.begin(cache, out.hidden[0])
    first = int(out.logits[0, -1].argmax())
    t0 = time.perf_counter()
    drafts = proposer.propose([*prompt, first], ALONE, SamplingParams(), None).tokens.tolist()
    return time.perf_counter() - t0, drafts


@contextmanager
def caches_in(dtype: str) -> Iterator[None]:
    """Drafters' caches as ``cache_dtype`` chooses ("float32" for bf16 drafters on a CPU) or, for "bfloat16", in
    their weights' dtype, as before ``cache_dtype`` existed."""
    chosen = Drafter.cache_dtype
    if dtype == "bfloat16":
        Drafter.cache_dtype = property(lambda self: self.weight_dtype)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        Drafter.cache_dtype = chosen  # type: ignore[method-assign]


def main() -> None:
    ap = parser(__doc__, per_file=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()

    lm = moaspec.load(drafter=args.drafter or "shipped", threads=args.threads, tree=moaspec.TreeShape(),
                      lookup=0)
    if lm.strategy.drafter is None or lm.strategy.drafter.weight_dtype != torch.bfloat16:
        raise SystemExit("this measures bf16 drafting, which this CPU does not use (no oneDNN bf16 kernels)")
    methods = {"moa tree": lm, "default (lookup + moa chains)": lm.with_decoding(),
               "eagle tree": lm.with_decoding(shipped_drafter(lm.target, "eagle"), tree=moaspec.TreeShape(), lookup=0)}
    prompts = [chat_messages(q.turns[0]) for q in questions(args)]
    totals = {(m, c): {"s": 0.0, "draft_s": 0.0, "tokens": 0, "calls": 0} for m in methods for c in CACHE_DTYPES}
    for model in methods.values():  # warm-up
        model.generate(prompts[0], max_new_tokens=16)
    for i, prompt in enumerate(prompts):
        for name, model in methods.items():
            texts = set()
            for cache in CACHE_DTYPES if i % 2 == 0 else CACHE_DTYPES[::-1]:
                with caches_in(cache):
                    out = model.generate(prompt, max_new_tokens=args.max_new_tokens)
                t = totals[(name, cache)]
                t["s"] += out.total_s
                t["draft_s"] += out.draft_s
                t["tokens"] += out.new_tokens
                t["calls"] += out.target_calls
                texts.add(out.text)
            if len(texts) != 1:
                raise SystemExit(f"prompt {i}, {name}: the text differs between cache dtypes")
    rows = {}
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, {args.threads} threads, drafters in bf16")
    for name in methods:
        base = totals[(name, "bfloat16")]
        for cache in CACHE_DTYPES:
            t = totals[(name, cache)]
            row = {"tokens_per_s": round(t["tokens"] / t["s"], 2),
                   "vs_bf16_caches": round((t["tokens"] / t["s"]) / (base["tokens"] / base["s"]), 3),
                   "draft_ms_per_cycle": round(1e3 * t["draft_s"] / t["calls"], 2),
                   "tau": round(t["tokens"] / t["calls"], 3)}
            rows[f"{name}, {cache} caches"] = row
            print(f"  {name:32s} {cache:8s} caches: {row['tokens_per_s']:6.2f} tok/s ({row['vs_bf16_caches']:.3f}x), "
                  f"drafting {row['draft_ms_per_cycle']:.2f} ms/cycle, tau {row['tau']:.3f}")
    alone = {c: 0.0 for c in CACHE_DTYPES}
    same = 0  # prompts after which both cache dtypes drafted the same ALONE tokens
    for i, prompt in enumerate(prompts):
        ids = encode_chat(lm.tokenizer, prompt)
        drafted = []
        for cache in CACHE_DTYPES if i % 2 == 0 else CACHE_DTYPES[::-1]:
            with caches_in(cache):
                seconds, drafts = drafting_alone(lm, ids)
            alone[cache] += seconds
            drafted.append(drafts)
        same += drafted[0] == drafted[1]
    rows["alone_same_drafts"] = same
    for cache in CACHE_DTYPES:
        rate = ALONE * len(prompts) / alone[cache]
        rows[f"moa alone, {cache} caches"] = {"drafted_tokens_per_s": round(rate, 1),
                                               "vs_bf16_caches": round(alone["bfloat16"] / alone[cache], 3)}
        print(f"  moa drafting {ALONE} tokens alone, {cache:8s} caches: {rate:6.1f} drafted tok/s "
              f"({alone['bfloat16'] / alone[cache]:.3f}x)")
    print(f"  the same {ALONE} drafts with both cache dtypes after {same} of {len(prompts)} prompts")
    write_results(args, prompts=len(prompts), settings=rows)


if __name__ == "__main__":
    main()
