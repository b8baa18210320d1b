"""What the MoA drafter's calls cost right after a target forward, against back to back, in one run.

In real decoding each drafting cycle follows a verification, which streams the target's
540 MB of weights through the caches. This times the drafter's two calls of a cycle,
``observe`` (taking in 2 verified tokens: Layer Self-Attention and the memory entries)
and a 1-draft ``propose``, four ways, interleaved round by round:

- back to back (warm);
- right after a 3-token target forward, as in decoding;
- right after a 64 MB memory sweep (the caches evicted, nothing else);
- with the drafter on one thread and the target on all of them.

The default target and the shipped drafter (or ``--drafter``), a 300-token random prompt, medians:

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/drafter_cold.py --threads 2 --repeats 60
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from moaspec.decoding import SamplingParams
from moaspec.drafters import load_drafter
from moaspec.drafters.proposers import proposer_for
from specbench_script import target_and_drafter_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", default=None, help="MoA drafter checkpoint directory (default: the shipped one)")
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    target, path = target_and_drafter_path(args)
    drafter = load_drafter(path, target)
    T = 300
    ids = torch.randint(0, target.cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    cache = target.model.new_cache(T + 64)
    junk = torch.zeros(64 * 1024 * 1024 // 4)
    with torch.inference_mode():
        out = target.model(ids, cache)
        state = drafter.new_state(T + 64)
        drafter.observe(state, cache, T - 2, None)
        proposer = proposer_for(drafter)
        proposer.begin(cache, out.hidden[0])
        tokens = ids[0].tolist() + [int(out.logits[0, -1].argmax())]
        proposer.propose(tokens, 1, SamplingParams(), None)

        def forward() -> None:
            target.model(ids[:, :3], cache)
            cache.truncate(T)

        settings: dict[str, tuple[Callable[[], None], int]] = {
            "back to back": (lambda: None, args.threads),
            "after a target forward": (forward, args.threads),
            "after a 64 MB memory sweep": (lambda: junk.add_(1.0), args.threads),
            "after a target forward, drafter on 1 thread": (forward, 1)}
        times: dict[str, dict[str, list[float]]] = {name: {"observe": [], "propose": []} for name in settings}
        for r in range(args.rounds):
            for name in (settings if r % 2 == 0 else reversed(list(settings))):
                before, threads = settings[name]
                for _ in range(args.repeats):
                    before()
                    torch.set_num_threads(threads)
                    state.memory.length = T - 2
                    a = time.perf_counter()
                    drafter.observe(state, cache, T, None)
                    b = time.perf_counter()
                    proposer.commit(T)
                    c = time.perf_counter()
                    proposer.propose(tokens, 1, SamplingParams(), None)
                    d = time.perf_counter()
                    torch.set_num_threads(args.threads)
                    times[name]["observe"].append(b - a)
                    times[name]["propose"].append(d - c)
    print(f"{args.threads} threads, medians of {args.rounds} x {args.repeats}:")
    for name, t in times.items():
        print(f"  {name:>44}: observe {1000 * statistics.median(t['observe']):.2f} ms, "
              f"1-draft propose {1000 * statistics.median(t['propose']):.2f} ms")


if __name__ == "__main__":
    main()
