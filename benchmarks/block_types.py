"""What each GGUF block type costs the kernel: one-row products (a decoding step's), per type, in one run.

Each type's weight is a [4096, 1536] matrix of random codes (the cost does not depend on their values) in 40
copies, 130–200 MB in all, so that a pass over the copies streams them from memory as a decoding step streams
a model's layers; "in cache" repeats one copy, the kernel's arithmetic alone. Medians over rounds, the types
interleaved within each round:

    .venv/bin/python benchmarks/block_types.py --threads 2

Where the CPU has AVX-512, both instruction sets' loops run side by side (``--isa`` picks); ``--rows 5`` times
the products of a verification of 5 tokens instead of a step's.

docs/models-and-precision.md gives the figures; the bits per weight include the scales.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moaspec.models import block_kernel
from moaspec.models.block_kernel import BLOCK, Q4K, Q5, Q5K, Q6K, SUPER, BlockWeights

OUT, IN, COPIES = 4096, 1536, 40
# name: (layout, code bytes per block of 32 or super-block of 256, whether it has offsets)
TYPES = {"Q4_0": (4, 16, True), "Q4_1": (4, 16, True), "Q5_0": (Q5, 20, True), "Q5_1": (Q5, 20, True),
         "Q8_0": (8, 32, False), "Q4_K": (Q4K, 140, True), "Q5_K": (Q5K, 172, True), "Q6_K": (Q6K, 208, False)}


def random_weights(name: str, seed: int) -> BlockWeights:
    bits, code_bytes, offsets = TYPES[name]
    per_scale = SUPER if bits in (Q4K, Q5K, Q6K) else BLOCK
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (OUT, IN // per_scale * code_bytes), dtype=torch.uint8, generator=g)
    scales = (torch.rand(OUT, IN // per_scale, generator=g) * 1e-3).half()
    return BlockWeights(bits, codes, scales, -scales if offsets else torch.zeros_like(scales))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--rows", type=int, default=1, help="activation rows per product (1: a decoding step's)")
    ap.add_argument("--isa", default=None, help="instruction sets' loops to compare, comma-separated "
                    "(default: every one this CPU has)")
    args = ap.parse_args()
    if (why := block_kernel.cpu_supported()) is not None or block_kernel.kernel() is None:
        raise SystemExit(f"block_types: no kernel here ({why or 'it could not be built'})")
    isas = args.isa.split(",") if args.isa else block_kernel.instruction_sets()
    if missing := [i for i in isas if i not in block_kernel.instruction_sets()]:
        raise SystemExit(f"block_types: this CPU has no {', '.join(missing)} loops")
    torch.set_num_threads(args.threads)
    weights = {name: [random_weights(name, i) for i in range(COPIES)] for name in TYPES}
    x = torch.randn(args.rows, IN)
    cells = [(isa, name) for isa in isas for name in TYPES]
    streamed: dict[tuple[str, str], list[float]] = {cell: [] for cell in cells}
    cached: dict[tuple[str, str], list[float]] = {cell: [] for cell in cells}
    for _ in range(args.rounds):
        for isa, name in cells:
            block_kernel.set_instruction_set(isa)
            copies = weights[name]
            t0 = time.perf_counter()
            for w in copies:
                block_kernel.product(x, w)
            streamed[isa, name].append((time.perf_counter() - t0) / COPIES)
            block_kernel.product(x, copies[0])
            t0 = time.perf_counter()
            for _ in range(COPIES):
                block_kernel.product(x, copies[0])
            cached[isa, name].append((time.perf_counter() - t0) / COPIES)
    print(f"products of {args.rows} row(s) with a [{OUT}, {IN}] weight, {args.threads} threads, "
          f"medians of {args.rounds} rounds")
    print(f"{'loops':7}{'type':6} {'bits/weight':>11} {'streamed µs':>12} {'GB/s':>6} {'in cache µs':>12} "
          f"{'weights/ns':>10}")
    for isa, name in cells:
        s, c = statistics.median(streamed[isa, name]), statistics.median(cached[isa, name])
        nbytes = weights[name][0].nbytes
        print(f"{isa:7}{name:6} {8 * nbytes / (OUT * IN):11.2f} {s * 1e6:12.0f} {nbytes / s / 1e9:6.1f} "
              f"{c * 1e6:12.0f} {args.rows * OUT * IN / c / 1e9:10.2f}")


if __name__ == "__main__":
    main()
