"""MKL's packed sgemm against oneDNN's packed weights, for the products of one SmolLM2-135M forward, by row count.

A lead for the target's verification forwards, not yet used by the runtime: on an Intel Xeon
(2026-12-02, docs/experiments/2026-12-02-mkl-packed-sgemm.md) ``torch.ops.mkl._mkl_linear`` on weights packed by
``torch.ops.mkl._mkl_reorder_linear_weight`` (what Inductor's CPU freezing uses for fp32 linears)
took 7-17% less time than oneDNN's packed weights for 1 to 128 rows. The pack takes a row-count hint
(``--hints``): a copy packed for 1 row is slow from 3 rows on, one packed for 8 rows from 11 rows on,
one packed for 64 rows is quick for every count tried. Each copy takes the dense weight's memory.
On an AMD EPYC (2026-12-04) the lead reversed: MKL's packed products took 1.3-3.7 times oneDNN's time.
Random weights of the runtime's shapes (fused qkv and gate/up, as benchmarks/experiments/int4_products.py), a
64 MB memory sweep before each round, medians of 9, the kernels alternated.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/mkl_packed_products.py --hints 1,8,64 --rows 1,3,4,8,11,16,32,64,128
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from int4_products import LAYERS, SHAPES

LM_HEAD = (49152, 576)  # SmolLM2-135M's vocabulary x width


def median_ms(fn: Callable[[], object], sweep: torch.Tensor, repeats: int = 9) -> float:
    times = []
    for _ in range(repeats):
        sweep.add_(1.0)  # evict the weights the previous round left in the caches
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeats // 2] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hints", default="1,8,16,32,64", help="row counts MKL's copies are packed for")
    ap.add_argument("--rows", default="1,3,4,8,11,16,24,32,64")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    weights = [torch.randn(o, i) for _ in range(LAYERS) for o, i in SHAPES] + [torch.randn(*LM_HEAD)]
    sweep = torch.empty(64 * 2**20 // 4)
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    hints = [int(h) for h in args.hints.split(",")]
    mkl = {h: [torch.ops.mkl._mkl_reorder_linear_weight(w, h) for w in weights] for h in hints}
    print("rows  " + "  ".join(["oneDNN ms"] + [f"MKL@{h} ms" for h in hints]))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {i: torch.randn(rows, i) for i in (576, 1536)}
        res: dict[str, float] = {}
        for _ in range(2):  # the first pass warms every path up; the second's figures are kept
            res["onednn"] = median_ms(lambda: [torch.ops.mkldnn._linear_pointwise(
                xs[w.shape[1]], p, None, "none", [], "") for w, p in zip(weights, onednn)], sweep)
            for h in hints:
                res[str(h)] = median_ms(lambda h=h: [torch.ops.mkl._mkl_linear(
                    xs[w.shape[1]], p, w, None, rows) for w, p in zip(weights, mkl[h])], sweep)
        print(f"{rows:>4}  {res['onednn']:>9.1f}" + "".join(f"  {res[str(h)]:>9.1f}" for h in hints), flush=True)


if __name__ == "__main__":
    main()
