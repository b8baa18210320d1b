"""Target features for training: computed on the fly vs read back from the fp16 cache, side by side.

Times, on the same batches of real distillation data, (a) the frozen target's pass
that produces every layer's K/V and the final hidden states, and (b) loading the
same features from the on-disk cache the trainer keeps. Prints tokens/s of each and
their ratio.

    .venv/bin/python benchmarks/feature_source.py --data ~/.cache/moaspec/data/smollm2-magpie-v1
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from moaspec.models import load_model
from moaspec.training.dataset import collate, load_examples, make_batches
from moaspec.training.features import FeatureStore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(None, device="cpu", with_tokenizer=False)
    train, _ = load_examples([Path(args.data)], lm.fingerprint, 768, 0.02)
    batches = [collate([train[i] for i in b]) for b in make_batches(train, args.tokens_per_batch, 0, 0)[: args.batches]]
    tokens = sum(int(b.lengths.sum()) for b in batches)
    root = Path(tempfile.mkdtemp(prefix="moaspec-features-"))
    try:
        store = FeatureStore(lm.model, 0)
        files = [[root / f"{k}.safetensors" for k in b.keys] for b in batches]
        t0 = time.perf_counter()
        for b, f in zip(batches, files):
            store.features(b.tokens, b.lengths, f)  # computes and writes
        compute = time.perf_counter() - t0
        t0 = time.perf_counter()
        for b, f in zip(batches, files):
            store.features(b.tokens, b.lengths, f)  # reads back
        read = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in root.iterdir())
    finally:
        shutil.rmtree(root)
    print(f"{tokens} tokens in {len(batches)} batches")
    print(f"computed (target pass + fp16 write): {tokens / compute:8.0f} tokens/s")
    print(f"read back from the cache:            {tokens / read:8.0f} tokens/s  ({tokens / read / (tokens / compute):.0f}x)")
    print(f"cache size: {size / tokens / 1024:.1f} KiB per token")


if __name__ == "__main__":
    main()
