"""Load test of `moaspec serve`: N concurrent streaming clients (the official openai package) for D seconds.

Starts the server as its own process (or uses --url), then each client sends SpecBench
first turns, one after another, streaming, until the time is up. Prints and writes
(--output) per-request latency and time-to-first-token percentiles, aggregate
generated tokens/s, errors, and the server's resident memory every 2 s (summarised per half and
per quarter by rss.py, to tell a plateau from growth).

    .venv/bin/python benchmarks/serve_load.py --clients 8 --seconds 180 --output bench-out/serve-load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

import openai

from moaspec.specbench import load_questions
from rss import rss_mb, rss_summary  # benchmarks/rss.py, beside this script
from served import serving

SPECBENCH = Path(__file__).resolve().parent.parent.parent / "shared" / "specbench"


def percentile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else (xs[0] if xs else 0.0)


async def client_loop(client: openai.AsyncOpenAI, model: str, prompts: list[str], start: int, until: float,
                      max_tokens: int, records: list[dict], errors: list[str]) -> None:
    i = start
    while time.perf_counter() < until:
        prompt = prompts[i % len(prompts)]
        i += 1
        t0 = time.perf_counter()
        ttft, tokens = None, 0
        try:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens,
                stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                    ttft = time.perf_counter() - t0
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
        except Exception as exc:  # every failure is counted and reported, none ends the run
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        records.append({"latency_s": time.perf_counter() - t0, "ttft_s": ttft or 0.0, "tokens": tokens,
                        "end": time.perf_counter()})


async def load(url: str, model: str, prompts: list[str], clients: int, seconds: float, max_tokens: int,
               server_pid: int | None) -> tuple[list[dict], list[str], list[float], float]:
    """The raw run (also serve_peer.py's, which times each request its own way): ``clients`` streaming clients for
    ``seconds``; returns the per-request records, the errors, the server's RSS samples and the wall time."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=os.environ.get("MOASPEC_API_KEY", "unused"),
                                max_retries=0, timeout=600)
    records: list[dict] = []
    errors: list[str] = []
    memory: list[float] = []
    t0 = time.perf_counter()
    until = t0 + seconds

    async def sample_memory() -> None:
        while time.perf_counter() < until and server_pid:
            memory.append(rss_mb(server_pid))
            await asyncio.sleep(2)

    async with client:  # closed in this event loop: a caller may run another one after it
        await asyncio.gather(sample_memory(), *(client_loop(client, model, prompts, k * 7, until, max_tokens, records,
                                                            errors) for k in range(clients)))
    wall = time.perf_counter() - t0  # includes the requests still in flight at the deadline
    return records, errors, memory, wall


async def run(url: str, model: str, prompts: list[str], clients: int, seconds: float, max_tokens: int,
              server_pid: int | None) -> dict:
    records, errors, memory, wall = await load(url, model, prompts, clients, seconds, max_tokens, server_pid)
    lat = [r["latency_s"] for r in records]
    ttft = [r["ttft_s"] for r in records]
    tokens = sum(r["tokens"] for r in records)
    return {
        "clients": clients, "seconds": round(wall, 1), "requests": len(records), "errors": len(errors),
        "error_examples": errors[:5], "generated_tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
        "latency_p50_s": round(percentile(lat, 50), 3), "latency_p95_s": round(percentile(lat, 95), 3),
        "ttft_p50_s": round(percentile(ttft, 50), 3), "ttft_p95_s": round(percentile(ttft, 95), 3),
        "mean_tokens_per_request": round(tokens / max(1, len(records)), 1),
        "server_rss_mb": rss_summary(memory),
        "server_rss_samples_mb": [round(m) for m in memory],  # every 2 s
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="an already running server (default: start `moaspec serve` here)")
    # no prompt cache by default: the clients cycle through the same questions, and a load test whose repeats read
    # their prompts for free would flatter the server (and differ from the runs before the cache existed)
    ap.add_argument("--serve-args", default="--prompt-cache-mb 0", help="arguments for the server this script starts "
                    "(default: --prompt-cache-mb 0)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--questions", default=str(SPECBENCH))
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--output", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    prompts = [q.turns[0] for q in load_questions(args.questions)]
    with ExitStack() as stack:
        server = None if args.url else stack.enter_context(serving(args.port, args.serve_args.split()))
        url = args.url or f"http://127.0.0.1:{args.port}"
        model = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("MOASPEC_API_KEY", "unused")).models.list().data[0].id
        result = asyncio.run(run(url, model, prompts, args.clients, args.seconds, args.max_tokens,
                                 server.pid if server else None))
    result.update({"model": model, "max_tokens": args.max_tokens, "serve_args": args.serve_args})
    print(json.dumps(result, indent=2, ensure_ascii=False))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
