"""Where a target forward's time goes: the layers' products, ``lm_head``, and everything else.

For each number of new tokens (after ``--context`` cached ones) and each path of a GGUF target's
products (its 4-bit blocks, the default; its dequantised fp32 weights): the whole forward, the 120
layer products and ``lm_head`` timed alone on random activations of the same shapes, and the forward
with every linear layer replaced by an empty result ("everything else": norms, RoPE, attention, the
cache and the Python between them). Medians of ``--repeats`` after two warm-ups.

    .venv/bin/python benchmarks/forward_breakdown.py --threads 2 --sizes 1,4,8
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from forward_cost import timing_target  # beside this script
from moaspec.models.gguf_blocks import dense_products
from moaspec.models.packed_linear import Linear


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        fn()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    args, model = timing_target(__doc__, "1,4,8", 15)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    layers, head = linears[:-1], model.lm_head
    gen = torch.Generator().manual_seed(0)
    cache = model.new_cache(args.context + 64)
    model(torch.randint(0, model.cfg.vocab_size, (1, args.context), generator=gen), cache)
    paths: dict[str, Callable[[], AbstractContextManager[None]]] = {
        "blocks": nullcontext, "fp32": lambda: dense_products(model)}
    if all(m.blocks is None for m in linears):
        del paths["blocks"]
    print(f"{'new tokens':>10} {'path':>7} {'forward ms':>11} {'layer products':>15} {'lm_head':>8} {'everything else':>16}")
    for T in (int(s) for s in args.sizes.split(",")):
        tokens = torch.randint(0, model.cfg.vocab_size, (1, T), generator=gen)
        xs = {m.in_features: torch.randn(T, m.in_features, generator=gen) for m in linears}

        def forward() -> None:
            cache.truncate(args.context)
            model(tokens, cache)

        for name, path in paths.items():
            with path(), torch.inference_mode():
                whole = median_ms(forward, args.repeats)
                products = median_ms(lambda: [m(xs[m.in_features]) for m in layers], args.repeats)
                head_ms = median_ms(lambda: head(xs[head.in_features]), args.repeats)
                saved = Linear.forward
                Linear.forward = lambda self, x: x.new_empty(*x.shape[:-1], self.out_features)  # type: ignore[method-assign]
                try:
                    rest = median_ms(forward, args.repeats)
                finally:
                    Linear.forward = saved  # type: ignore[method-assign]
            print(f"{T:>10} {name:>7} {whole:>11.1f} {products:>15.1f} {head_ms:>8.1f} {rest:>16.1f}", flush=True)


if __name__ == "__main__":
    main()
