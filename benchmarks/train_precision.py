"""Training a drafter on a CPU in fp32 against bf16 autocast: loss tokens/s and loss, side by side.

``moaspec train --mixed-precision auto`` chooses bf16 autocast on a GPU and, on a CPU whose oneDNN has
bf16 kernels (``moaspec.models.packed_linear.bf16_kernels``), there too. This measures what that choice
is worth: two copies of one freshly initialised drafter (the trainer's own initialisation) take the same
updates on the same batches of real distillation data with the same masks, one in fp32 and one under
bf16 autocast (fp32 master weights either way), the two alternating update by update (which goes first
alternates too) so that machine noise hits both alike. The target's features are computed once, before
timing (as the trainer's feature cache serves them after its first epoch), so each timed update is the
drafter's forward, backward and optimizer step alone. Prints each update's losses and times, then loss
tokens/s of each precision, their ratio, and the mean loss of the last quarter of the updates.

    .venv/bin/python benchmarks/train_precision.py --data ~/.cache/moaspec/data/s64 --updates 24
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moaspec.models import load_model
from moaspec.training.dataset import batch_stream
from moaspec.training.distill import build_masks, drafter_loss
from moaspec.training.trainer import TrainConfig, Trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, nargs="+", help="directories made by `moaspec data`")
    ap.add_argument("--kind", default="moa", choices=("moa", "eagle", "independent"))
    ap.add_argument("--updates", type=int, default=24, help="updates per precision (the first one untimed)")
    ap.add_argument("--batches", type=int, default=6, help="distinct batches, taken in turn")
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(None, device="cpu", with_tokenizer=True)
    cfg = TrainConfig(kind=args.kind, steps=args.updates, tokens_per_batch=args.tokens_per_batch, lr=args.lr,
                      warmup=1, mixed_precision="no", cache_features=False, seed=args.seed)
    trainers = []
    for _ in range(2):  # the same seed: the same initial drafter, attached to the one target
        with tempfile.TemporaryDirectory(prefix="moaspec-precision-") as out:
            trainers.append(Trainer(lm, [Path(d) for d in args.data], Path(out), cfg, progress=False))
    trainer = trainers[0]
    stream = batch_stream(trainer.examples_for, cfg.tokens_per_batch, cfg.seed, 0, 1)
    gen = torch.Generator().manual_seed(args.seed)
    batches = []
    for _ in range(args.batches):  # features computed here, untimed, as the feature cache would serve them
        batch = next(stream)
        masks = build_masks(batch, gen, torch.zeros(batch.tokens.shape[0], dtype=torch.bool), cfg.segment_min,
                            cfg.segment_max)
        batches.append((batch, masks, trainer.target_features(batch)))
    runs = {}
    for name, t in zip(("fp32", "bf16"), trainers):
        drafter = t.raw
        optim = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        runs[name] = {"drafter": drafter, "optim": optim, "times": [], "losses": [], "tokens": 0}

    def update(name: str, batch, masks, tgt) -> None:  # type: ignore[no-untyped-def]
        r = runs[name]
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name == "bf16"):
            out = drafter_loss(r["drafter"], lm.model, batch, masks, tgt)
        out.loss.total.backward()
        torch.nn.utils.clip_grad_norm_(r["drafter"].parameters(), cfg.clip)
        r["optim"].step()
        r["optim"].zero_grad()
        r["times"].append(time.perf_counter() - t0)
        r["losses"].append(float(out.loss.total.detach()))
        r["tokens"] += int(masks.loss.sum())
        r.setdefault("first_tokens", r["tokens"])

    print("update  loss tokens  fp32 s  bf16 s  fp32 loss  bf16 loss")
    for i in range(args.updates):
        batch, masks, tgt = batches[i % len(batches)]
        order = ("fp32", "bf16") if i % 2 == 0 else ("bf16", "fp32")
        for name in order:
            update(name, batch, masks, tgt)
        f, b = runs["fp32"], runs["bf16"]
        print(f"{i + 1:>6}  {int(masks.loss.sum()):>11}  {f['times'][-1]:>6.2f}  {b['times'][-1]:>6.2f}  "
              f"{f['losses'][-1]:>9.4f}  {b['losses'][-1]:>9.4f}", flush=True)
    tail = max(1, args.updates // 4)
    # the first update of each warms oneDNN's kernels up: its time is not counted
    rate = {n: (r["tokens"] - r["first_tokens"]) / sum(r["times"][1:]) for n, r in runs.items()}
    for n, r in runs.items():
        print(f"{n}: {rate[n]:7.0f} loss tokens/s, mean loss of the last {tail} updates "
              f"{statistics.mean(r['losses'][-tail:]):.4f}")
    print(f"bf16 / fp32 tokens/s: {rate['bf16'] / rate['fp32']:.2f}x")


if __name__ == "__main__":
    main()
