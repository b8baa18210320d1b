"""Throughput of batched answer generation for `moaspec data`: fixed batches against refilled ones.

Both modes run the same requests (Magpie user prompts written by the target, half
answered greedily, half sampled, as `moaspec data` does) in one process, alternating,
so the ratio is measured under the same machine load. Fixed batches run each batch
until its last row ends (``refill_below=0``); refilled batches pause the survivors
when fewer than half are alive and refill from the waiting requests. Greedy answers
must be identical in both modes, and the script checks that.

    .venv/bin/python benchmarks/datagen_speed.py --requests 64 --batch-size 32 --max-new-tokens 384
"""

from __future__ import annotations

import argparse
import time

import torch

from moaspec.chat import encode_chat
from moaspec.decoding.batched import Request, generate_many
from moaspec.decoding.opening import stop_token_ids
from moaspec.decoding.sampling import SamplingParams
from moaspec.models import load_model
from moaspec.training.datagen import TASKS, pre_query_prefix, usable_query


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each mode, alternating")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model()
    tok, stop = lm.tokenizer, stop_token_ids(lm.model, lm.tokenizer)

    tasks = list(TASKS)
    prefixes = [tok(pre_query_prefix(tok, [{"role": "system", "content": TASKS[tasks[i % len(tasks)]]}]),
                    add_special_tokens=False)["input_ids"] for i in range(2 * args.requests)]
    queries = generate_many(lm.model, [Request(p, 96, SamplingParams(temperature=1.0)) for p in prefixes], stop,
                            torch.Generator().manual_seed(0), batch_size=args.batch_size)
    texts = [tok.decode(ids, skip_special_tokens=True).strip() for ids, done in queries if done]
    texts = [q for q in texts if usable_query(q)][: args.requests]
    hot = SamplingParams(temperature=0.7)
    requests = [Request(encode_chat(tok, [{"role": "user", "content": q}]), args.max_new_tokens,
                        SamplingParams() if i % 2 == 0 else hot) for i, q in enumerate(texts)]
    print(f"{len(requests)} requests, batch size {args.batch_size}, at most {args.max_new_tokens} new tokens, "
          f"{args.threads} threads")

    modes = {"fixed batches": 0.0, "refilled": 0.5}
    wall = dict.fromkeys(modes, 0.0)
    tokens = dict.fromkeys(modes, 0)
    greedy: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        for name in (list(modes) if r % 2 == 0 else list(reversed(modes))):
            t0 = time.perf_counter()
            out = generate_many(lm.model, requests, stop, torch.Generator().manual_seed(1), batch_size=args.batch_size,
                                refill_below=modes[name])
            wall[name] += time.perf_counter() - t0
            tokens[name] += sum(len(ids) for ids, _ in out)
            greedy[name] = [ids for (ids, _), req in zip(out, requests) if req.sampling.greedy]
    base = tokens["fixed batches"] / wall["fixed batches"]
    print(f"{'mode':<14} {'tokens':>8} {'wall s':>8} {'tok/s':>8} {'ratio':>6}")
    for name in modes:
        rate = tokens[name] / wall[name]
        print(f"{name:<14} {tokens[name]:>8} {wall[name]:>8.1f} {rate:>8.1f} {rate / base:>6.2f}")
    same = greedy["fixed batches"] == greedy["refilled"]
    print(f"greedy answers identical in both modes: {same}")


if __name__ == "__main__":
    main()
