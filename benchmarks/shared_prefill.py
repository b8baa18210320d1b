"""n choices of one long prompt: read once and copied (the default) against each reading it, alternated in one run.

Through the server's engine (`moaspec serve`'s), the default target with its shipped drafter,
a prompt of about ``--prompt-tokens`` tokens (SpecBench turns joined), ``--n`` sampled
choices of ``--max-new-tokens`` tokens each, all slots free. The unshared runs swap the
engine's ``SharedRead`` for one that lets every choice read the prompt itself.

    .venv/bin/python benchmarks/shared_prefill.py --prompt-tokens 1500 --n 4 --repeats 3
"""

from __future__ import annotations

import asyncio
import time

import torch

from moaspec.chat import encode_text
from moaspec.cores import Cores
from moaspec.decoding import GenerationConfig, SamplingParams
from moaspec.decoding.generation import GenerationResult
from moaspec.decoding.prefill import SharedRead
from moaspec.drafters import load_drafter, shipped_drafter
from moaspec.models import load_model
from moaspec.serving import Engine
from moaspec.serving import engine as engine_module
from moaspec.strategy import Strategy
from specbench_script import parser, questions, write_results


class ReadEach(SharedRead):
    """Every caller reads the prompt itself (what happened before choices shared their read)."""

    def __call__(self, prompt_ids, cache, read):  # type: ignore[no-untyped-def, override]
        return read()


def main() -> None:
    ap = parser(__doc__, per_file=10)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(None, device="cpu")
    strategy = Strategy(load_drafter(args.drafter or shipped_drafter(lm), lm))
    text = "\n\n".join(q.turns[0] for q in questions(args))
    prompt = encode_text(lm.tokenizer, text)[: args.prompt_tokens]
    engine = Engine(lm, strategy, parallel=args.n, max_queue=0, cores=Cores(args.threads, max(1, args.threads // args.n)))
    configs = [GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=SamplingParams(0.8, seed=i))
               for i in range(args.n)]

    async def answer() -> float:
        t = time.perf_counter()
        done = [item async for _, item in engine.streams([prompt] * args.n, configs) if isinstance(item, GenerationResult)]
        assert len(done) == args.n
        return time.perf_counter() - t

    times: dict[str, list[float]] = {"shared": [], "each": []}
    try:
        asyncio.run(answer())  # warm-up
        for r in range(args.repeats):
            for name in (("shared", "each") if r % 2 == 0 else ("each", "shared")):
                engine_module.SharedRead = SharedRead if name == "shared" else ReadEach  # type: ignore[misc]
                times[name].append(asyncio.run(answer()))
    finally:
        engine_module.SharedRead = SharedRead  # type: ignore[misc]
        engine.close()
    best = {name: min(ts) for name, ts in times.items()}
    print(f"{len(prompt)}-token prompt, n = {args.n}, {args.max_new_tokens} tokens each, {args.threads} threads")
    for name, ts in times.items():
        print(f"  {name:>6}: all choices done in {best[name]:.2f} s (best of {len(ts)}: {', '.join(f'{t:.2f}' for t in ts)})")
    print(f"  each / shared: {best['each'] / best['shared']:.2f}x")
    write_results(args, prompt_tokens=len(prompt), seconds=times)


if __name__ == "__main__":
    main()
