"""Cost of one target forward by number of new tokens, packed vs plain linears, in one run.

This is the curve that decides chain lengths and tree budgets: how much more a
verification of T tokens costs than a single decoding step. The table uses the 1-row
padding as this process measured it; a last line times a 1-token forward with the
padding forced off and on, alternately.

    .venv/bin/python benchmarks/forward_cost.py --context 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moaspec.models import load_model
from moaspec.models.packed_linear import PAD_ROWS, pack_linears, set_single_row_padding


def elapsed_ms(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def median_ms(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    return statistics.median_high([elapsed_ms(fn) for _ in range(repeats)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=200, help="cached tokens before the new ones")
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, device="cpu", with_tokenizer=False).model
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, model.cfg.vocab_size, (1, args.context), generator=gen)
    sizes = [int(s) for s in args.sizes.split(",")]
    cache = model.new_cache(args.context + max(sizes))
    model(prefix, cache)
    print(f"{'new tokens':>10}{'packed ms':>11}{'plain ms':>10}{'plain/packed':>14}{'packed vs T=1':>15}")
    base = None
    for T in sizes:
        toks = torch.randint(0, model.cfg.vocab_size, (1, T), generator=gen)

        def step() -> None:
            cache.truncate(args.context)
            model(toks, cache)

        res = {}
        for packed in (True, False):
            pack_linears(model, enable=packed)
            res[packed] = median_ms(step, args.repeats)
        pack_linears(model)
        base = base or res[True]
        print(f"{T:>10}{res[True]:>11.1f}{res[False]:>10.1f}{res[False] / res[True]:>14.2f}{res[True] / base:>15.2f}")
    toks = torch.randint(0, model.cfg.vocab_size, (1, 1), generator=gen)

    def one() -> None:
        cache.truncate(args.context)
        model(toks, cache)

    padded: dict[bool, list[float]] = {False: [], True: []}
    for pad in padded:  # warm both paths once
        set_single_row_padding(pad)
        one()
    for _ in range(args.repeats):
        for pad in padded:
            set_single_row_padding(pad)
            padded[pad].append(elapsed_ms(one))
    plain, pad = (statistics.median_high(v) for v in padded.values())
    print(f"1 new token, 1-row products padded to {PAD_ROWS} rows: {pad:.1f} ms against {plain:.1f} ms as is "
          f"({pad / plain:.2f}x)")


if __name__ == "__main__":
    main()
