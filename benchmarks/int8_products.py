"""Every product of one MoA drafting step, on packed bf16 weights and on int8 copies, by row count, in one run.

Why ``INT8_MAX_ROWS`` is what it is (``moaspec/models/packed_linear.py``): aten's
weight-only int8 kernel streams half the bytes of oneDNN's packed bf16 product, but
its time grows with the rows, so past some row count the packed weight is faster.
This runs each of the drafter's own linear layers and its head once per round (what a
drafting step multiplies), both ways, alternating, each round after a 64 MB memory
sweep (the caches evicted, as the target's forward leaves them in decoding); medians:

    .venv/bin/python benchmarks/int8_products.py --threads 2

``--fp32-activations`` adds the same products in fp32, on oneDNN's packed fp32 weights and through
the int8 kernel with fp32 activations: why int8 copies take bf16 activations only (``int8_supported``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from moaspec.drafters import load_drafter
from moaspec.models.packed_linear import Linear
from specbench_script import target_and_drafter_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", default=None, help="drafter checkpoint directory (default: the shipped MoA drafter)")
    ap.add_argument("--rows", default="1,2,4,8,12,16,32,64,256", help="comma list of row counts")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--fp32-activations", action="store_true", help="also fp32 products, packed and through the int8 kernel")
    args = ap.parse_args()
    target, path = target_and_drafter_path(args)  # sets --threads
    drafter = load_drafter(path, target, torch.bfloat16).use_int8()
    layers = [m for m in drafter.modules() if isinstance(m, Linear)] + [drafter._borrowed["head"]]
    if any(m.int8 is None or m.packed is None for m in layers):
        raise SystemExit("this CPU lacks oneDNN's bf16 kernels or aten's int8 product: nothing to compare")
    int8 = {m: m.int8 for m in layers}
    for m in layers:  # so that m(x) is the packed bf16 product at every row count
        m.int8 = None
    ways: dict[str, Callable[[Linear, torch.Tensor, torch.Tensor], object]] = {
        "packed bf16": lambda m, x, x32: m(x),
        "int8": lambda m, x, x32: torch.ops.aten._weight_int8pack_mm(x, *int8[m])}
    if args.fp32_activations:
        packed32 = {m: torch.ops.mkldnn._reorder_linear_weight(m.weight.float()) for m in layers}
        int8_32 = {m: (q, scales.float()) for m, (q, scales) in int8.items()}
        ways["packed fp32"] = lambda m, x, x32: torch.ops.mkldnn._linear_pointwise(x32, packed32[m], None, "none", [], "")
        ways["int8, fp32 act."] = lambda m, x, x32: torch.ops.aten._weight_int8pack_mm(x32, *int8_32[m])
    junk = torch.zeros(64 * 2**20 // 4)
    mb = sum(m.weight.numel() for m in layers) / 2**20
    print(f"{len(layers)} products, {2 * mb:.1f} MB in bf16, {mb:.1f} MB in int8; ms")
    print(f"{'rows':>5}" + "".join(f"{w:>17}" for w in ways) + f"{'int8 / bf16':>13}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(rows, m.in_features, dtype=torch.bfloat16) for m in layers]
            x32s = [x.float() for x in xs]
            times: dict[str, list[float]] = {w: [] for w in ways}
            for _ in range(args.repeats):
                for way, product in ways.items():
                    junk.add_(1.0)
                    t0 = time.perf_counter()
                    for m, x, x32 in zip(layers, xs, x32s):
                        product(m, x, x32)
                    times[way].append(time.perf_counter() - t0)
            ms = {w: statistics.median(t) * 1e3 for w, t in times.items()}
            print(f"{rows:>5}" + "".join(f"{v:>17.3f}" for v in ms.values()) + f"{ms['int8'] / ms['packed bf16']:>13.2f}")


if __name__ == "__main__":
    main()
