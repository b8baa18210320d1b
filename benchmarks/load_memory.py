"""Peak memory of loading a target on the CPU, with and without the prepacked weight copies.

Each load runs in a fresh process (peak RSS is per process), on a model directory given with
--model or a random Llama written here in bf16, the form most checkpoints ship in, loaded in
fp32 as moaspec runs every target. Prints the fp32 weight bytes beside the peaks (above what the
process held once its imports were done), so the ratio says how many copies of the weights a
load holds at its worst.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, resource, sys, time
from moaspec.models import load_model_dir
import torch.nn.functional  # what a load imports, so that its memory is not counted as the load's
imported = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
model = load_model_dir(sys.argv[1], device="cpu", with_tokenizer=False).model
weights = sum(p.nbytes for p in model.parameters())
print(json.dumps({"weights": weights, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - imported,
                  "load_s": time.perf_counter() - t0}))
"""


def random_model(path: Path, layers: int, hidden: int, mlp: int, vocab: int) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                               num_hidden_layers=layers, num_attention_heads=hidden // 64,
                               num_key_value_heads=max(1, hidden // 256), max_position_embeddings=4096,
                               tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(str(path), safe_serialization=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="an HF model directory (default: a random 309 M Llama in bf16)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--mlp", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else random_model(Path(tmp) / "m", args.layers, args.hidden, args.mlp,
                                                                 args.vocab)
        print(f"{'MOASPEC_PACK':>12} {'fp32 weights GiB':>17} {'peak RSS GiB (above imports)':>29} {'peak / weights':>15} {'load s':>7}")
        for pack in ("1", "0"):
            env = dict(os.environ, MOASPEC_PACK=pack)
            out = subprocess.run([sys.executable, "-c", CHILD, str(model)], env=env, capture_output=True, text=True,
                                 check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{pack:>12} {r['weights'] / 2**30:>17.2f} {r['peak'] / 2**30:>29.2f} "
                  f"{r['peak'] / r['weights']:>15.2f} {r['load_s']:>7.1f}")


if __name__ == "__main__":
    main()
