"""Answer tokens/s of `moaspec data` and loss tokens/s of drafters trained together, on this machine.

Writes a small data set (the target answers built-in prompts, `--data-examples` of them, in
batches of `--data-batch-size`), then trains the drafters of `--arms` together on it, the
target's features computed once per batch for all of them (`moaspec train --arms`). The first
`--warmup` updates (allocation, autotuning) are left out of the figures. Per drafter it prints
the loss tokens it learnt from and the seconds of its own passes, and for the run the loss tokens
of all drafters per second of training: the figure `moaspec train --arms` reaches. The timing
synchronises the device between the target's pass and each drafter's (a little slower than a
real run). One JSON line on stdout.

    .venv/bin/python benchmarks/train_throughput.py --arms moa,eagle --train-seconds 60
    python3 benchmarks/train_throughput.py --device cuda --tokens-per-batch 65536 --data-batch-size 256

Runs on a CPU with a tiny model too (the tests do); `scripts/gpu_slot.sh` runs it as its probe and
sizes its training from ``s_per_update``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

# topics × asks: distinct prompts of a few lengths (the answers' lengths are what they are)
TOPICS = ("a bicycle gear", "photosynthesis", "a binary search", "the water cycle", "compound interest",
          "a hash table", "volcanoes", "the French revolution", "vaccines", "a sorting algorithm in Python")
ASKS = ("Explain {} to a child.", "Write a short story that involves {}.", "List five facts about {}.",
        "What are common misconceptions about {}? Answer in detail.")


def prompts(n: int) -> list[str]:
    """``n`` distinct built-in prompts (`moaspec data` skips repeated ones)."""
    base = [ask.format(topic) for ask in ASKS for topic in TOPICS]
    return [p if i < len(base) else f"{p} (Take {i // len(base) + 1}.)" for i, p in
            ((i, base[i % len(base)]) for i in range(n))]


def write_data(target, out: Path, examples: int, batch_size: int, max_answer_tokens: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """A data directory of ``examples`` answers written by ``target``; its answer tokens and seconds."""
    from moaspec.training.datagen import MIN_PASSAGE_TOKENS, DataConfig, generate_dataset
    from moaspec.training.user_text import load_user_text

    file = out.parent / "prompts.jsonl"
    file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts(examples)))
    user = load_user_text([file], None, 512, MIN_PASSAGE_TOKENS, None, None, None)
    cfg = DataConfig(examples=examples, shard_size=examples, batch_size=batch_size,
                     max_answer_tokens=max_answer_tokens, multi_turn=0.0, pasted_fraction=0.0)
    t0 = time.perf_counter()
    manifest = generate_dataset(target, out, cfg, progress=False, user=user)
    seconds = time.perf_counter() - t0
    tokens = sum(s["answer_tokens"] for s in manifest["shards"])
    return {"answer_tokens": tokens, "data_s": round(seconds, 2), "answer_tokens_per_s": round(tokens / seconds, 1)}


def train(target, data: Path, work: Path, args: argparse.Namespace) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Train the arms together for ``args.train_seconds`` after ``args.warmup`` updates; what each took."""
    from moaspec.training.trainer import TrainConfig, Trainer, train_together

    trainers: list[Trainer] = []
    for kind in args.arms.split(","):
        cfg = TrainConfig(kind=kind, steps=10**6, tokens_per_batch=args.tokens_per_batch, draft_vocab=args.draft_vocab,
                          max_len=args.max_len, eval_every=10**6, save_every=10**6, val_fraction=0.05,
                          mixed_precision=args.mixed_precision, cache_features=False, log_every=10**6)
        data_for = trainers[0].data if trainers else data
        trainers.append(Trainer(target, data_for, work / kind, cfg, progress=False, compile=args.compile))
    train_together(trainers, until=args.warmup)
    first, tokens0 = trainers[0].step, {t.out.name: t.tokens for t in trainers}  # counted at the warm-up's last row
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    train_together(trainers, timings=timings, until=args.warmup + args.max_updates, time_limit=args.train_seconds)
    wall = time.perf_counter() - t0
    updates = trainers[0].step - first
    learnt = {t.out.name: t.tokens - tokens0[t.out.name] for t in trainers}  # the last update logs: all counted
    arms = {name: {"loss_tokens": n, "seconds": round(timings.get(name, 0.0), 2), "loss_tokens_per_s": round(n / wall, 1)}
            for name, n in learnt.items()}
    together = sum(learnt.values())
    return {"updates": updates, "train_s": round(wall, 4), "s_per_update": round(wall / max(updates, 1), 4),
            "target_s": round(timings.get("target", 0.0), 2), "arms": arms,
            "loss_tokens_per_s_together": round(together / wall, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="the target (default: the embedded default model)")
    ap.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    ap.add_argument("--dtype", default="float32", help="the target's dtype (fp32: the deployed target's features)")
    ap.add_argument("--arms", default="moa,eagle", help="drafter kinds trained together, comma-separated")
    ap.add_argument("--tokens-per-batch", type=int, default=16384)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--mixed-precision", default="auto", choices=("auto", "no", "fp16", "bf16"))
    ap.add_argument("--compile", action="store_true", help="the drafters' training passes through torch.compile")
    ap.add_argument("--data-examples", type=int, default=64, help="answers written, and trained on")
    ap.add_argument("--data-batch-size", type=int, default=64)
    ap.add_argument("--max-answer-tokens", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2, help="updates before the timing starts")
    ap.add_argument("--train-seconds", type=float, default=10.0, help="timed training (after the warm-up)")
    ap.add_argument("--max-updates", type=int, default=10**6, help="timed updates at most")
    ap.add_argument("--work", type=Path, default=None, help="where the data and runs go (default: a temporary one)")
    args = ap.parse_args(argv)

    from moaspec.models import load_model

    t0 = time.perf_counter()
    target = load_model(args.model, device=args.device, dtype=args.dtype)
    report: dict[str, object] = {"device": str(target.model.device), "load_s": round(time.perf_counter() - t0, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        report.update(write_data(target, work / "data", args.data_examples, args.data_batch_size,
                                 args.max_answer_tokens))
        report.update(train(target, work / "data", work / "runs", args))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
