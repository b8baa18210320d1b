"""Client–server decoding with penalties and log-probabilities: what each costs, side by side in one run.

A real `moaspec serve` (its own process, pinned to one core) and a MoA client here (the
other core), over loopback; the client's defaults (prompt lookup, then the drafter's
chains). Per prompt (the first turn of the first K questions of every SpecBench file,
greedy) the four settings run back to back, in alternating order. Penalties change the
text, so the script checks each penalised answer against plain decoding on this machine
under the same settings, and the others against plain greedy decoding.

    .venv/bin/python benchmarks/cs_options.py --per-file 2 --presence 0.5 --frequency 0.5
"""

from __future__ import annotations

import os

import torch

from moaspec.chat import chat_messages, encode_chat
from moaspec.clientserver.client import RemoteTarget, SplitGeneration
from moaspec.decoding import GenerationConfig, SamplingParams, generate
from moaspec.decoding.lookup import DEFAULT_LOOKUP
from moaspec.decoding.opening import stop_token_ids
from moaspec.drafters import load_drafter
from served import serving
from specbench_script import add_penalty_arguments, parser, questions, target_and_drafter_path, write_results


def main() -> None:
    ap = parser(__doc__, per_file=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    add_penalty_arguments(ap)
    ap.add_argument("--logprobs", type=int, default=5, help="alternatives per token where log-probabilities are asked")
    ap.add_argument("--port", type=int, default=8811)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    server_core = cores[-1] if len(cores) > 1 else None
    if server_core is not None:
        os.sched_setaffinity(0, {cores[0]})
        args.threads = 1
    target, path = target_and_drafter_path(args)
    drafter = load_drafter(path, target)
    eos = stop_token_ids(target.model, target.tokenizer)
    penalties = SamplingParams(presence_penalty=args.presence, frequency_penalty=args.frequency)
    settings = {"plain": GenerationConfig(max_new_tokens=args.max_new_tokens),
                "penalties": GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=penalties),
                "logprobs": GenerationConfig(max_new_tokens=args.max_new_tokens, logprobs=args.logprobs),
                "both": GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=penalties, logprobs=args.logprobs)}
    prompts = [encode_chat(target.tokenizer, chat_messages(q.turns[0])) for q in questions(args)]
    context = target.cfg.max_position_embeddings
    totals = {name: {"s": 0.0, "tokens": 0, "calls": 0, "accepted": 0, "bytes": 0} for name in settings}
    url = f"http://127.0.0.1:{args.port}"
    with serving(args.port, ["--threads", "1", "--prompt-cache-mb", "0"], server_core):
        remote = RemoteTarget(url, timeout=120)
        max_draft = int(remote.info()["max_draft"])

        def client() -> SplitGeneration:
            return SplitGeneration(drafter, target.tokenizer, remote, eos, lookup=DEFAULT_LOOKUP, max_draft=max_draft)

        client().run(prompts[0], GenerationConfig(max_new_tokens=16), context)  # warm-up
        for i, prompt in enumerate(prompts):
            with torch.inference_mode():
                want = {name: generate(target.model, target.tokenizer, prompt, settings[name]).token_ids
                        for name in ("plain", "penalties")}
            names = list(settings) if i % 2 == 0 else list(settings)[::-1]
            for name in names:
                with torch.inference_mode():
                    r = client().run(prompt, settings[name], context)
                if r.token_ids != want["penalties" if settings[name].sampling.penalized else "plain"]:
                    raise SystemExit(f"prompt {i}, {name}: the answer differs from plain decoding's")
                t = totals[name]
                t["s"] += r.total_s
                t["tokens"] += len(r.token_ids)
                t["calls"] += len(r.accepted_lengths)
                t["accepted"] += sum(r.accepted_lengths)
                t["bytes"] += r.bytes_sent + r.bytes_received
            print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
        remote.shutdown()
    rows = {name: {"tokens_per_s": round(t["tokens"] / t["s"], 2), "tau": round(t["accepted"] / t["calls"], 3),
                   "bytes_per_token": round(t["bytes"] / t["tokens"], 1)} for name, t in totals.items()}
    base = rows["plain"]["tokens_per_s"]
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, greedy, server and client one core each; "
          f"penalties: presence {args.presence}, frequency {args.frequency}; logprobs: top {args.logprobs}")
    for name, row in rows.items():
        print(f"  {name:>9}: {row['tokens_per_s']:6.2f} tok/s ({row['tokens_per_s'] / base:.3f}x plain), "
              f"tau {row['tau']:.3f}, {row['bytes_per_token']:7.1f} bytes/token")
    write_results(args, rows=rows)


if __name__ == "__main__":
    main()
