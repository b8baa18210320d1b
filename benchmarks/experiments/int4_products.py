"""Would int4 weights pay on this CPU? The target's linear products, fp32 against torch's int4 weight-only kernel.

The default target ships as Q4_1 (GGUF) and is dequantised to fp32 at load, so decoding
streams 8x the bytes its weights hold. torch's ``_weight_int4pack_mm_for_cpu`` reads
4-bit weights with a scale and zero per group of 32 (Q4_1's own form: scale d, zero
m + 8d); whether it is fast depends on the CPU (a scalar fallback on AVX2, vectorised
with AVX-512) and on the activations' dtype. This times the products of a SmolLM2-135M
forward (30 layers of the fused shapes, random weights, each weight its own copy so
that they stream from memory) for a few row counts: MKL's ``F.linear`` and oneDNN's
packed fp32 weights (what the runtime runs) against int4 with bf16 and fp32 activations.
Nothing here changes decoding: int4 with bf16 activations is a different, lower
precision target, and would need its own vanilla baseline.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/int4_products.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # fused qkv, o, fused gate/up, down
LAYERS = 30
GROUP = 32


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,4,8,16")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    weights = [torch.randn(out, inp) for _ in range(LAYERS) for out, inp in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    int4 = [(torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, w.shape, dtype=torch.int32), 2),
             torch.randn(w.shape[1] // GROUP, w.shape[0], 2)) for w in weights]
    zb = [z.bfloat16() for _, z in int4]  # the kernel wants scales and zeros in the activations' dtype
    print(f"{'rows':>5}{'fp32 MKL ms':>13}{'fp32 packed ms':>16}{'int4 bf16 ms':>14}{'int4 fp32 ms':>14}")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {inp: torch.randn(rows, inp) for _, inp in SHAPES}
        xb = {inp: x.bfloat16() for inp, x in xs.items()}
        with torch.inference_mode():
            mkl = median_ms(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], args.repeats)
            pk = median_ms(lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                    for w, p in zip(weights, packed)], args.repeats)
            q_bf16 = median_ms(lambda: [torch._weight_int4pack_mm_for_cpu(xb[w.shape[1]], q, GROUP, z)
                                        for w, (q, _), z in zip(weights, int4, zb)], args.repeats)
            q_fp32 = median_ms(lambda: [torch._weight_int4pack_mm_for_cpu(xs[w.shape[1]], q, GROUP, z)
                                        for w, (q, z) in zip(weights, int4)], max(1, args.repeats // 5))
        print(f"{rows:>5}{mkl:>13.1f}{pk:>16.1f}{q_bf16:>14.1f}{q_fp32:>14.1f}")


if __name__ == "__main__":
    main()
