"""Client–server throughput with many clients: a server that verifies their sessions together against one at a time.

Starts two `moaspec serve` processes, one with `--no-batch`, both pinned to the same core
(they take turns; only one is busy at a time), and runs C MoA client threads here, pinned to
the other core, each answering SpecBench first turns one after another through `/cs/v1`
(the shipped drafter, greedy, pipelined, chains of 2) for S seconds. The two servers are
measured alternately, R rounds (``--no-pin``: servers and clients share every core). Prints tokens/s over all clients per server and their ratio,
and checks that both servers gave the same answers to the prompts both answered.

    .venv/bin/python benchmarks/cs_batching.py --clients 8 --seconds 60 --rounds 2 --output bench-out/cs-batching.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from moaspec.chat import chat_messages, encode_chat
from moaspec.clientserver.client import RemoteTarget, SplitGeneration
from moaspec.decoding import GenerationConfig
from moaspec.decoding.opening import stop_token_ids
from moaspec.drafters import load_drafter, shipped_drafter
from moaspec.models import load_model
from moaspec.specbench import load_questions
from served import serving

SPECBENCH = Path(__file__).resolve().parent.parent.parent / "shared" / "specbench"


def load(url: str, clients: int, seconds: float, run) -> tuple[float, dict[int, list[int]], int]:  # type: ignore[no-untyped-def]
    """C clients answering prompts in turn against ``url`` for ``seconds``: tokens/s, answers by prompt, failures."""
    answers: dict[int, list[int]] = {}
    tokens, failures = [0] * clients, [0]
    until = time.perf_counter() + seconds

    def client(k: int) -> None:
        i = k * 7
        while time.perf_counter() < until:
            try:
                ids = run(url, i)
                answers[i] = ids
                tokens[k] += len(ids)
            except Exception:  # counted; the benchmark reports it
                failures[0] += 1
            i += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (time.perf_counter() - t0), answers, failures[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=8801, help="the batching server; the other gets the next port")
    ap.add_argument("--questions", default=str(SPECBENCH))
    ap.add_argument("--no-pin", action="store_true", help="servers and clients on every core (they share them)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    server_core, client_core = (cores[-1], cores[0]) if len(cores) > 1 and not args.no_pin else (None, None)
    if client_core is not None:
        os.sched_setaffinity(0, {client_core})
    target = load_model()
    drafter = load_drafter(shipped_drafter(target), target)
    eos = stop_token_ids(target.model, target.tokenizer)
    prompts = [encode_chat(target.tokenizer, chat_messages(q.turns[0])) for q in load_questions(args.questions)]
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)

    def run(url: str, i: int) -> list[int]:
        remote = RemoteTarget(url, timeout=120)
        try:
            r = SplitGeneration(drafter, target.tokenizer, remote, eos).run(prompts[i % len(prompts)], cfg,
                                                                            target.cfg.max_position_embeddings)
        finally:
            remote.shutdown()
        return r.token_ids

    setups = {"together": [], "one at a time (--no-batch)": ["--no-batch"]}
    rates: dict[str, list[float]] = {name: [] for name in setups}
    answers: dict[str, dict[int, list[int]]] = {name: {} for name in setups}
    failures = 0
    with ExitStack() as stack:
        urls = {}
        for k, (name, options) in enumerate(setups.items()):
            stack.enter_context(serving(args.port + k, ["--no-draft", "--prompt-cache-mb", "0", *options], server_core))
            urls[name] = f"http://127.0.0.1:{args.port + k}"
            run(urls[name], 0)  # warm-up
        for r in range(args.rounds):
            for name in (setups if r % 2 == 0 else reversed(setups)):
                rate, got, failed = load(urls[name], args.clients, args.seconds, run)
                rates[name].append(rate)
                answers[name].update(got)
                failures += failed
                print(f"round {r + 1}: {name}: {rate:.1f} tokens/s", flush=True)
    a, b = answers.values()
    common = sorted(set(a) & set(b))
    same = sum(a[i] == b[i] for i in common)
    together, alone = (statistics.median(v) for v in rates.values())
    print(f"{args.clients} clients, {args.max_new_tokens} tokens, greedy: together {together:.1f} tokens/s, one at a "
          f"time {alone:.1f} tokens/s, ratio {together / alone:.2f}; same answers {same} of {len(common)}; "
          f"failures {failures}")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"clients": args.clients, "seconds": args.seconds,
                                                 "tokens_per_s": rates, "same_answers": same, "compared": len(common),
                                                 "failures": failures}, indent=2) + "\n")


if __name__ == "__main__":
    main()
