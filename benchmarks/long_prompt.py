"""Long prompts: time to the first token and memory, prefill in chunks against in one pass.

A causal forward of many tokens (a prompt's prefill; a drafter catching up on the prompt; the
MoA drafter's Layer Self-Attention over every layer of every prompt token) runs a chunk at a time
(``moaspec.models.transformer.PREFILL_CHUNKS``, ``moaspec.drafters.moa.LSA_CHUNK``). This runs the
main job's tree decoding on prompts of several lengths both ways, each run in a fresh process
(alternating which goes first), and prints per length: the target's prefill in seconds, the time
to the last of ``--new-tokens`` tokens (which adds the drafter taking in the prompt, then decoding),
the peak resident memory above what the process held before the prompt (sampled every 2 ms), and
whether the two generated the same tokens. The prompts are this repository's own Markdown, cut to length
(so their text changes as the files do; their lengths do not).
``--transformers`` also times transformers' own forward of each prompt (the prefill of its
``generate``, SDPA attention, logits of the last position only), in a process of its own.
``--training B,S`` instead times what training computes on the fly, the target's pass over a
batch of B sequences of S tokens that yields every layer's K/V and the final states
(``moaspec.training.features.target_pass``), chunked and in one pass, alternating, in one process.

    .venv/bin/python benchmarks/long_prompt.py --lengths 1000,2000,4000,8000 --threads 2 [--transformers]
    .venv/bin/python benchmarks/long_prompt.py --training 4,1024 --threads 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def document_ids(tokenizer: object, length: int) -> list[int]:
    """The first ``length`` token ids of this repository's Markdown files, read in name order."""
    text = "".join(p.read_text() for p in sorted(REPO.glob("*.md")))
    return tokenizer.encode(text)[:length]  # type: ignore[attr-defined]


CHILD = r"""
import json, sys, threading, time
import psutil, torch
sys.path.insert(0, sys.argv[5])
from long_prompt import document_ids
from moaspec.decoding import GenerationConfig
from moaspec.strategy import Strategy
from moaspec.decoding.tree import TreeShape
from moaspec.drafters import load_drafter, moa, shipped_drafter
from moaspec.models import load_model, transformer

length, mode, threads, new_tokens = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
if mode == "one-pass":
    transformer.PREFILL_CHUNKS["cpu"] = 1 << 30
    moa.LSA_CHUNK = 1 << 30
lm = load_model(None, device="cpu")
strategy = Strategy(load_drafter(str(shipped_drafter(lm)), lm), tree=TreeShape())
ids = document_ids(lm.tokenizer, length)
strategy.run(lm, ids[:64], GenerationConfig(max_new_tokens=8))  # warm-up: kernels chosen, caches made
process = psutil.Process()
before, peak, running = process.memory_info().rss, [0], [True]

def sample() -> None:
    while running[0]:
        peak[0] = max(peak[0], process.memory_info().rss)
        time.sleep(0.002)

sampler = threading.Thread(target=sample)
sampler.start()
out = strategy.run(lm, ids, GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True))
running[0] = False
sampler.join()
result = out.to_dict()
print(json.dumps({"prefill_s": result["prefill_s"], "total_s": result["total_s"], "tokens": out.token_ids,
                  "peak_mib": (peak[0] - before) / 2**20}))
"""


HF_CHILD = r"""
import json, sys, time
import torch
sys.path.insert(0, sys.argv[3])
from long_prompt import document_ids
from transformers import AutoModelForCausalLM
from moaspec.models import load_model

length, threads = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
lm = load_model(None, device="cpu")
hf = AutoModelForCausalLM.from_pretrained(str(lm.path), dtype=torch.float32).eval()
ids = torch.tensor([document_ids(lm.tokenizer, length)])
with torch.no_grad():
    hf(ids[:, :64], logits_to_keep=1)  # warm-up
    start = time.perf_counter()
    hf(ids, logits_to_keep=1)
print(json.dumps({"prefill_s": time.perf_counter() - start}))
"""


def run(length: int, mode: str, threads: int, new_tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(length), mode, str(threads), str(new_tokens), str(HERE)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_transformers(length: int, threads: int) -> float:
    out = subprocess.run([sys.executable, "-c", HF_CHILD, str(length), str(threads), str(HERE)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["prefill_s"]


def training_pass(batch: int, length: int, threads: int, repeats: int = 3) -> None:
    """Time the training features' target pass, chunked and in one pass (see the module's docstring)."""
    import time

    import torch

    from moaspec.models import load_model, transformer
    from moaspec.training.features import target_pass

    torch.set_num_threads(threads)
    lm = load_model(None, device="cpu")
    ids = document_ids(lm.tokenizer, batch * length)
    tokens = torch.tensor([ids[i * length : (i + 1) * length] for i in range(batch)])
    chunk = transformer.PREFILL_CHUNKS["cpu"]
    target_pass(lm.model, tokens, 0)  # warm-up
    seconds: dict[str, list[float]] = {"chunked": [], "one-pass": []}
    for _ in range(repeats):
        for mode in seconds:
            transformer.PREFILL_CHUNKS["cpu"] = chunk if mode == "chunked" else 1 << 30
            start = time.perf_counter()
            target_pass(lm.model, tokens, 0)
            seconds[mode].append(time.perf_counter() - start)
    for mode, times in seconds.items():
        best = min(times)
        print(f"{batch} x {length} tokens, {mode:>9}: best of {repeats} {best:.2f} s, {batch * length / best:,.0f} tokens/s")
    print(f"one-pass / chunked: {min(seconds['one-pass']) / min(seconds['chunked']):.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1000,2000,4000,8000", help="prompt lengths in tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--transformers", action="store_true", help="also time transformers' forward of each prompt")
    ap.add_argument("--training", default=None, metavar="B,S",
                    help="time training's target pass over B sequences of S tokens instead")
    ap.add_argument("--output", default=None, help="also write the results here as JSON")
    args = ap.parse_args()
    if args.training:
        batch, length = (int(n) for n in args.training.split(","))
        training_pass(batch, length, args.threads)
        return
    rows = []
    print(f"{'tokens':>7} {'mode':>9} {'prefill s':>10} {f'to token {args.new_tokens} s':>16} {'peak MiB':>9}")
    for i, length in enumerate(int(n) for n in args.lengths.split(",")):
        modes = ("chunked", "one-pass") if i % 2 == 0 else ("one-pass", "chunked")
        got = {mode: run(length, mode, args.threads, args.new_tokens) for mode in modes}
        for mode in ("chunked", "one-pass"):
            r = got[mode]
            print(f"{length:>7} {mode:>9} {r['prefill_s']:>10.2f} {r['total_s']:>16.2f} {r['peak_mib']:>9.0f}")
        same = got["chunked"]["tokens"] == got["one-pass"]["tokens"]
        print(f"{'':>7} one-pass / chunked: prefill {got['one-pass']['prefill_s'] / got['chunked']['prefill_s']:.2f}x, "
              f"memory {got['one-pass']['peak_mib'] / max(got['chunked']['peak_mib'], 1):.1f}x; same tokens: {same}")
        row = {"length": length, **{m: {k: v for k, v in r.items() if k != "tokens"} for m, r in got.items()},
               "same_tokens": same}
        if args.transformers:
            row["transformers_prefill_s"] = hf = run_transformers(length, args.threads)
            print(f"{'':>7} transformers' prefill {hf:.2f} s: {hf / got['chunked']['prefill_s']:.2f}x the chunked one's")
        rows.append(row)
    if args.output:
        from moaspec.fileio import atomic_write_text

        atomic_write_text(args.output, json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
