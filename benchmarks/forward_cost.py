"""Cost of one target forward by number of new tokens, for each way of running its linears, in one run.

This is the curve that decides chain lengths and tree budgets: how much more a
verification of T tokens costs than a single decoding step. For a GGUF target "blocks" is the
runtime's default: the file's 4-bit blocks through the compiled kernel (products of up to
``BLOCK_MAX_ROWS`` rows), inside the compiled layers (``decode_layers.cpp``); "torch-ops" reads the
same blocks with the layers' other operations run by torch, one Python call each. "measured" runs the dequantised fp32 weights as a model directory
does (per small row count, the kernel this process measured fastest at load); the other columns
force one fp32 kernel for every small product: oneDNN's prepacked weights ("packed"), the same
on rows zero-padded to ``PAD_ROWS`` ("padded", below ``PAD_ROWS`` tokens only) and MKL's
``F.linear`` ("plain", which then also runs the larger products). The settings alternate within
each repeat, so machine noise hits all alike.

    .venv/bin/python benchmarks/forward_cost.py --context 200
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

from moaspec.models import Transformer, load_model
from moaspec.models.fused_layers import torch_layers
from moaspec.models.gguf_blocks import dense_products
from moaspec.models.packed_linear import (
    PAD_ROWS,
    Linear,
    SmallRowKernels,
    pack_linears,
    set_small_row_kernels,
    small_row_kernels,
)


def elapsed_ms(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def timing_target(doc: str, sizes: str, repeats: int) -> tuple[argparse.Namespace, Transformer]:
    """The options a forward-timing script takes (``--model``, ``--context``, ``--sizes``, ``--repeats``,
    ``--threads``), parsed and applied, and the target loaded on the CPU (also ``forward_breakdown.py``'s)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=200, help="cached tokens before the new ones")
    ap.add_argument("--sizes", default=sizes, help="numbers of new tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args, load_model(args.model, device="cpu", with_tokenizer=False).model


def main() -> None:
    args, model = timing_target(__doc__, "1,2,4,8,16,32,64", 10)
    measured = small_row_kernels()
    print(f"kernels measured at load: {measured}")
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, model.cfg.vocab_size, (1, args.context), generator=gen)
    sizes = [int(s) for s in args.sizes.split(",")]
    cache = model.new_cache(args.context + max(sizes))
    model(prefix, cache)
    blocks = any(m.blocks is not None for m in model.modules() if isinstance(m, Linear))
    fused = model.fused is not None
    names = (["blocks"] if blocks else []) + (["torch-ops"] if fused else []) + ["measured", "packed", "padded", "plain"]
    print(f"{'new tokens':>10}" + "".join(f"{n + ' ms':>13}" for n in names) + f"{names[0] + ' vs T=1':>17}")
    base = None
    for T in sizes:
        toks = torch.randint(0, model.cfg.vocab_size, (1, T), generator=gen)
        settings = {"blocks": measured, "torch-ops": measured, "measured": measured, "packed": SmallRowKernels.uniform("packed"),
                    "padded": SmallRowKernels.uniform("padded"), "plain": None}
        if not blocks:
            del settings["blocks"]
        if not fused:
            del settings["torch-ops"]
        if T >= PAD_ROWS:
            del settings["padded"]
        times: dict[str, list[float]] = {n: [] for n in settings}

        def step() -> None:
            cache.truncate(args.context)
            model(toks, cache)

        for rep in range(args.repeats + 1):  # the first round warms every path up
            for name, kernels in settings.items():
                pack_linears(model, enable=kernels is not None)
                set_small_row_kernels(kernels or measured)
                path = {"blocks": nullcontext(), "torch-ops": torch_layers(model)}.get(name) or dense_products(model)
                with path:
                    ms = elapsed_ms(step)
                if rep:
                    times[name].append(ms)
        pack_linears(model)
        set_small_row_kernels(measured)
        res = {n: statistics.median(ts) for n, ts in times.items()}
        base = base or res[names[0]]
        print(f"{T:>10}" + "".join(f"{res[n]:>13.1f}" if n in res else f"{'-':>13}" for n in names)
              + f"{res[names[0]] / base:>17.2f}")


if __name__ == "__main__":
    main()
