"""Throughput of batched answer generation for `moaspec data` at several batch sizes, in one run.

Every batch size runs the same requests (Magpie user prompts written by the target, half
answered greedily, half sampled, as `moaspec data` does) in one process, the sizes alternating
over rounds, so the ratios are measured under the same machine load. Continuous batching
(`moaspec/decoding/batched.py`) gives each sequence its own cache, so greedy answers must be
the same at every batch size; the script checks that.

    .venv/bin/python benchmarks/datagen_speed.py --requests 48 --batch-sizes 1,16,32 --max-new-tokens 256 --threads 1
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
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--batch-sizes", default="1,16,32", help="comma-separated; the first is the baseline of the ratios")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each batch size, the order reversed every round")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    torch.set_num_threads(args.threads)
    lm = load_model()
    tok, stop = lm.tokenizer, stop_token_ids(lm.model, lm.tokenizer)

    tasks = list(TASKS)
    prefixes = [tok(pre_query_prefix(tok, [{"role": "system", "content": TASKS[tasks[i % len(tasks)]]}]),
                    add_special_tokens=False)["input_ids"] for i in range(2 * args.requests)]
    queries = generate_many(lm.model, [Request(p, 96, SamplingParams(temperature=1.0)) for p in prefixes], stop,
                            torch.Generator().manual_seed(0), batch_size=max(sizes))
    texts = [tok.decode(ids, skip_special_tokens=True).strip() for ids, done in queries if done]
    texts = [q for q in texts if usable_query(q)][: args.requests]
    hot = SamplingParams(temperature=0.7)
    requests = [Request(encode_chat(tok, [{"role": "user", "content": q}]), args.max_new_tokens,
                        SamplingParams() if i % 2 == 0 else hot) for i, q in enumerate(texts)]
    print(f"{len(requests)} requests, at most {args.max_new_tokens} new tokens, {args.threads} threads")

    wall = dict.fromkeys(sizes, 0.0)
    tokens = dict.fromkeys(sizes, 0)
    greedy: dict[int, list[list[int]]] = {}
    for r in range(args.rounds):
        for size in (sizes if r % 2 == 0 else list(reversed(sizes))):
            t0 = time.perf_counter()
            out = generate_many(lm.model, requests, stop, torch.Generator().manual_seed(1), batch_size=size)
            wall[size] += time.perf_counter() - t0
            tokens[size] += sum(len(ids) for ids, _ in out)
            greedy[size] = [ids for (ids, _), req in zip(out, requests) if req.sampling.greedy]
    base = tokens[sizes[0]] / wall[sizes[0]]
    print(f"{'batch size':>10} {'tokens':>8} {'wall s':>8} {'tok/s':>8} {'ratio':>6}")
    for size in sizes:
        rate = tokens[size] / wall[size]
        print(f"{size:>10} {tokens[size]:>8} {wall[size]:>8.1f} {rate:>8.1f} {rate / base:>6.2f}")
    same = all(greedy[s] == greedy[sizes[0]] for s in sizes)
    print(f"greedy answers identical at every batch size: {same}")


if __name__ == "__main__":
    main()
