"""Whether llama.cpp scores a batch of new tokens exactly as it scores them one at a time.

Lossless greedy speculation needs a verification forward of k drafted tokens to give, for each
of them, the logits that plain decoding would: then its argmax is plain decoding's, bit for bit.
This runtime keeps that (its fp32 kernels' rounding hardly depends on the row count, and the
tests check the outputs). Whether llama.cpp does decides whether a llama.cpp-backed target could
be verified losslessly against its own plain decoding. For several random contexts of the default
GGUF file, this evaluates k continuation tokens at once after the context and compares each row's
logits with those of the same tokens evaluated one by one: per batch size, how many rows are
bitwise equal, the largest difference, and whether the argmax agrees.

    .venv/bin/pip install llama-cpp-python==0.3.36
    .venv/bin/python benchmarks/llama_cpp_rows.py --contexts 6 --max-batch 8
"""

from __future__ import annotations

import argparse

import numpy as np

from llama_cpp_peer import load_llama  # beside this script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, default=6, help="random contexts, 40 to 600 tokens long")
    ap.add_argument("--max-batch", type=int, default=8, help="batch sizes 2..this")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    llm = load_llama(args.threads, 1024, logits_all=True)
    vocab = llm.n_vocab()
    rng = np.random.default_rng(args.seed)
    equal = {k: [0, 0] for k in range(2, args.max_batch + 1)}  # batch size -> [rows bitwise equal, rows]
    worst = dict.fromkeys(equal, 0.0)
    argmax_agrees = dict.fromkeys(equal, True)
    for _ in range(args.contexts):
        context = [int(t) for t in rng.integers(100, vocab, int(rng.integers(40, 600)))]
        tokens = [int(t) for t in rng.integers(100, vocab, args.max_batch)]
        llm.reset()
        llm.eval(context)
        single = []
        for t in tokens:  # one at a time: what plain decoding computes
            llm.eval([t])
            single.append(np.array(llm.scores[llm.n_tokens - 1]))
        for k in equal:
            llm.reset()
            llm.eval(context)
            llm.eval(tokens[:k])
            batch = np.array(llm.scores[len(context) : len(context) + k])
            alone = np.stack(single[:k])
            equal[k][0] += int((batch == alone).all(-1).sum())
            equal[k][1] += k
            worst[k] = max(worst[k], float(np.abs(batch - alone).max()))
            argmax_agrees[k] &= bool((batch.argmax(-1) == alone.argmax(-1)).all())
    print(f"{'batch':>5}{'rows bitwise equal':>20}{'largest difference':>20}{'argmax agrees':>15}")
    for k, (same, rows) in equal.items():
        print(f"{k:>5}{f'{same} / {rows}':>20}{worst[k]:>20.3g}{'yes' if argmax_agrees[k] else 'NO':>15}")


if __name__ == "__main__":
    main()
