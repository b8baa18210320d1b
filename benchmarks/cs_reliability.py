"""Reliability of the client–server protocol: C concurrent MoA clients on one server for S seconds.

Starts `moaspec serve` as its own process, then runs C client threads here, each
generating answers to SpecBench first turns one after another through `/cs/v1`
(MoA drafter, greedy, pipelined) until the time is up. Reports failed requests
(any exception a client sees), completed generations, tokens/s over all clients,
and the server's resident memory sampled every 2 s (summarised per half and per quarter by
rss.py, to tell a plateau from growth).

    .venv/bin/python benchmarks/cs_reliability.py --clients 16 --seconds 300 --output bench-out/cs-reliability.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

from moaspec.chat import chat_messages, encode_chat
from moaspec.clientserver.client import RemoteTarget, SplitGeneration
from moaspec.decoding import GenerationConfig
from moaspec.decoding.opening import stop_token_ids
from moaspec.drafters import load_drafter, shipped_drafter
from moaspec.drafters.base import Drafter
from moaspec.models import load_model
from moaspec.models.loading import LoadedModel
from moaspec.specbench import load_questions
from rss import rss_mb, rss_summary  # benchmarks/rss.py, beside this script
from served import serving

SPECBENCH = Path(__file__).resolve().parent.parent.parent / "shared" / "specbench"


def stress(args: argparse.Namespace, server_pid: int, drafter: Drafter, target: LoadedModel, eos: set[int],
           prompts: list[list[int]]) -> dict:
    """Run the clients against the server on ``args.port`` until the time is up; the figures."""
    url = f"http://127.0.0.1:{args.port}"
    failures: list[str] = []
    done: list[int] = []
    memory: list[float] = []
    until = time.perf_counter() + args.seconds

    def client(k: int) -> None:
        i = k * 11
        while time.perf_counter() < until:
            remote = RemoteTarget(url, timeout=60)
            try:
                gen = SplitGeneration(drafter, target.tokenizer, remote, eos)
                r = gen.run(prompts[i % len(prompts)], GenerationConfig(max_new_tokens=args.max_new_tokens),
                            target.cfg.max_position_embeddings)
                if r.unverified:
                    failures.append(f"client {k}: {r.unverified} tokens left unverified")
                done.append(len(r.token_ids))
            except Exception as exc:  # every failure counts; none ends the run
                failures.append(f"client {k}: {type(exc).__name__}: {exc}")
            finally:
                remote.shutdown()
            i += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        memory.append(rss_mb(server_pid))
        time.sleep(2)
    wall = time.perf_counter() - t0
    return {
        "clients": args.clients, "seconds": round(wall, 1), "generations": len(done), "failures": len(failures),
        "failure_examples": failures[:5], "tokens": sum(done), "tokens_per_s": round(sum(done) / wall, 2),
        "server_rss_mb": rss_summary(memory),
        "server_rss_samples_mb": [round(m) for m in memory],  # every 2 s
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=8795)
    ap.add_argument("--questions", default=str(SPECBENCH))
    ap.add_argument("--output", default=None)
    args = ap.parse_args()

    target = load_model()
    drafter = load_drafter(shipped_drafter(target), target)
    eos = stop_token_ids(target.model, target.tokenizer)
    prompts = [encode_chat(target.tokenizer, chat_messages(q.turns[0])) for q in load_questions(args.questions)]
    with serving(args.port, ["--no-draft"]) as server:
        result = stress(args, server.pid, drafter, target, eos, prompts)
    print(json.dumps(result, indent=2))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
