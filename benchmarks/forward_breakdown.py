"""Where a target forward's time goes: the layers' products, ``lm_head``, and everything else.

For each number of new tokens (after ``--context`` cached ones) and each path of a GGUF target
(its 4-bit blocks inside the compiled layers, the default; the same blocks with the rest of each layer
run by torch, "torch-ops"; its dequantised fp32 weights): the whole forward, the 120 layer products and
``lm_head`` timed alone on random activations of the same shapes, and everything else (norms, RoPE,
attention, the cache and the calls between them). For the torch paths that is the forward timed with
every linear layer replaced by an empty result; the compiled layers call their products from C++, so for
them it is the forward less the products and ``lm_head`` (marked *). Medians of ``--repeats`` after two
warm-ups.

    .venv/bin/python benchmarks/forward_breakdown.py --threads 2 --sizes 1,4,8
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from forward_cost import timing_target  # beside this script
from moaspec.models.fused_layers import torch_layers
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
        "blocks": nullcontext, "torch-ops": lambda: torch_layers(model), "fp32": lambda: dense_products(model)}
    if model.fused is None:
        del paths["torch-ops"]
    if all(m.blocks is None for m in linears):
        del paths["blocks"]
    print(f"{'new tokens':>10} {'path':>9} {'forward ms':>11} {'layer products':>15} {'lm_head':>8} {'everything else':>16}")
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
                if model.fused is not None:  # its products are called from C++: the rest is what remains
                    print(f"{T:>10} {name:>9} {whole:>11.1f} {products:>15.1f} {head_ms:>8.1f} "
                          f"{whole - products - head_ms:>15.1f}*", flush=True)
                    continue
                saved = Linear.forward
                Linear.forward = lambda self, x: x.new_empty(*x.shape[:-1], self.out_features)  # type: ignore[method-assign]
                try:
                    rest = median_ms(forward, args.repeats)
                finally:
                    Linear.forward = saved  # type: ignore[method-assign]
            print(f"{T:>10} {name:>9} {whole:>11.1f} {products:>15.1f} {head_ms:>8.1f} {rest:>16.1f}", flush=True)


if __name__ == "__main__":
    main()
