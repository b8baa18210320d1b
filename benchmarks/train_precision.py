"""Training a drafter on a CPU: fp32, bf16 autocast and a compiled bf16 pass, side by side.

``moaspec train --mixed-precision auto`` chooses bf16 autocast on a GPU and, on a CPU whose oneDNN has
bf16 kernels (``moaspec.models.packed_linear.bf16_kernels``), there too; ``--compile`` runs the drafter's
training pass through ``torch.compile`` (``moaspec.training.compiled``). This measures what each is
worth: copies of one freshly initialised drafter (the trainer's own initialisation) take the same
updates on the same batches of real distillation data with the same masks, one per variant (fp32
master weights in all), alternating update by update in a rotating order so that machine noise hits
all alike. The target's features are computed once, before timing (as the trainer's feature cache
serves them after its first epoch), so each timed update is the drafter's forward, backward and
optimizer step alone; each variant's first update (oneDNN's kernels warming up) is not timed, and the
compilation happens before it, in the gradient check below.

Before any update, each variant's gradient on the first batch is compared with fp32's (all copies hold
the same weights then): ``|g - g_fp32| / |g_fp32|`` over all parameters, what its rounding costs. Then
each update's losses and times, and per variant loss tokens/s, its ratio to fp32, and the mean loss of
the last quarter of the updates.

    .venv/bin/python benchmarks/train_precision.py --data ~/.cache/moaspec/data/train-precision --updates 24 --compile
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moaspec.drafters.base import Drafter
from moaspec.models import load_model
from moaspec.training.dataset import batch_stream
from moaspec.training.distill import build_masks, drafter_loss
from moaspec.training.trainer import TrainConfig, Trainer


@dataclass
class Variant:
    name: str
    bf16: bool
    drafter: Drafter
    optim: torch.optim.Optimizer
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, nargs="+", help="directories made by `moaspec data`")
    ap.add_argument("--kind", default="moa", choices=("moa", "eagle", "independent"))
    ap.add_argument("--updates", type=int, default=24, help="updates per variant (the first one untimed)")
    ap.add_argument("--batches", type=int, default=6, help="distinct batches, taken in turn")
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--compile", action="store_true", help="add bf16 with the training pass compiled")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(None, device="cpu", with_tokenizer=True)
    cfg = TrainConfig(kind=args.kind, steps=args.updates, tokens_per_batch=args.tokens_per_batch, lr=args.lr,
                      warmup=1, mixed_precision="no", cache_features=False, seed=args.seed)
    settings = [("fp32", False, False), ("bf16", True, False)] + ([("bf16+compile", True, True)] if args.compile else [])
    variants = []
    for name, bf16, compiled in settings:  # the same seed: the same initial drafter, attached to the one target
        with tempfile.TemporaryDirectory(prefix="moaspec-precision-") as out:
            t = Trainer(lm, [Path(d) for d in args.data], Path(out), cfg, progress=False, compile=compiled)
        optim = torch.optim.AdamW(t.raw.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        variants.append(Variant(name, bf16, t.raw, optim))
    stream = batch_stream(t.data.examples_for, cfg.tokens_per_batch, cfg.seed, 0, 1)
    gen = torch.Generator().manual_seed(args.seed)
    batches = []
    for _ in range(args.batches):  # features computed here, untimed, as the feature cache would serve them
        batch = next(stream)
        masks = build_masks(batch, gen, torch.zeros(batch.tokens.shape[0], dtype=torch.bool), cfg.segment_min,
                            cfg.segment_max)
        batches.append((batch, masks, t.data.target_features(batch)))

    def backward(v: Variant, batch, masks, tgt) -> float:  # type: ignore[no-untyped-def]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=v.bf16):
            out = drafter_loss(v.drafter, lm.model, batch, masks, tgt)
        out.loss.total.backward()
        return float(out.loss.total.detach())

    grads = []
    for v in variants:
        backward(v, *batches[0])
        grads.append([p.grad.detach().clone() for p in v.drafter.parameters() if p.grad is not None])
        v.optim.zero_grad()
    ref = grads[0]
    norm = sum(float(g.pow(2).sum()) for g in ref) ** 0.5
    for v, g in zip(variants, grads):
        error = sum(float((a - b).pow(2).sum()) for a, b in zip(g, ref, strict=True)) ** 0.5 / norm
        print(f"{v.name}: gradient on the first batch, relative error against fp32's: {error:.5f}")

    def update(v: Variant, batch, masks, tgt) -> None:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        loss = backward(v, batch, masks, tgt)
        torch.nn.utils.clip_grad_norm_(v.drafter.parameters(), cfg.clip)
        v.optim.step()
        v.optim.zero_grad()
        v.times.append(time.perf_counter() - t0)
        v.losses.append(loss)
        v.tokens.append(int(masks.loss.sum()))

    print("update  loss tokens  " + "  ".join(f"{v.name + ' s':>14}  {v.name + ' loss':>17}" for v in variants))
    for i in range(args.updates):
        batch, masks, tgt = batches[i % len(batches)]
        for k in range(len(variants)):
            update(variants[(i + k) % len(variants)], batch, masks, tgt)
        print(f"{i + 1:>6}  {int(masks.loss.sum()):>11}  "
              + "  ".join(f"{v.times[-1]:>14.2f}  {v.losses[-1]:>17.4f}" for v in variants), flush=True)
    tail = max(1, args.updates // 4)
    rate = {v.name: sum(v.tokens[1:]) / sum(v.times[1:]) for v in variants}
    for v in variants:
        print(f"{v.name}: {rate[v.name]:7.0f} loss tokens/s ({rate[v.name] / rate['fp32']:.2f}x fp32), mean loss of "
              f"the last {tail} updates {statistics.mean(v.losses[-tail:]):.4f}")


if __name__ == "__main__":
    main()
