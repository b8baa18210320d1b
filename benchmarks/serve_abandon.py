"""A client that gives up during a long prompt's prefill: how soon does `moaspec serve` serve the next one?

Starts the server with one decoding slot (`--parallel 1`, so the abandoned request holds the
only one), then, for a streaming and a non-streaming request, side by side in one run:

* a short chat request alone: how long until its answer begins (streaming: its first text
  chunk; not streaming: the whole response);
* a request whose prompt is the first ``--prompt-tokens`` tokens of this repository's
  Markdown files (sent as token ids to ``/v1/completions``), abandoned after
  ``--abandon-after`` seconds, and at once the same short request: the same time.

The difference is what the abandoned prefill still cost the next client.

    .venv/bin/python benchmarks/serve_abandon.py --prompt-tokens 7800 --output bench-out/serve-abandon.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

from long_prompt import document_ids  # benchmarks/long_prompt.py, beside this script
from moaspec.models.loading import load_tokenizer
from moaspec.models.sources import resolve_model
from served import serving, sse_chunks

SHORT = "Name three primary colours."


def answer_begins(client: httpx.Client, model: str, stream: bool) -> float:
    """Seconds until the short request's answer begins."""
    body = {"model": model, "messages": [{"role": "user", "content": SHORT}], "max_tokens": 16, "temperature": 0,
            "stream": stream}
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        if not stream:
            r.read()
            return time.perf_counter() - t0
        for chunk in sse_chunks(r):
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                return time.perf_counter() - t0
    raise RuntimeError("the short request streamed no text")


def abandon(base: str, model: str, prompt: list[int], stream: bool, after_s: float) -> None:
    """Send the long request and drop the connection after ``after_s`` seconds, as a client that gives up."""
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": stream}
    try:
        with httpx.Client(base_url=base, timeout=after_s) as c, c.stream("POST", "/v1/completions", json=body) as r:
            r.read()
    except httpx.TimeoutException:
        return
    raise RuntimeError(f"the long request finished within {after_s} s: use a longer prompt or --abandon-after")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=7800)
    ap.add_argument("--abandon-after", type=float, default=2.0, help="seconds before the long request is dropped")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--serve-args", default="", help="more arguments for the server")
    ap.add_argument("--output", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    prompt = document_ids(load_tokenizer(resolve_model(None)), args.prompt_tokens)
    base = f"http://127.0.0.1:{args.port}"
    rows: dict[str, dict[str, list[float]]] = {}
    with serving(args.port, ["--parallel", "1", *args.serve_args.split()]), httpx.Client(base_url=base, timeout=600) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        answer_begins(c, model, stream=True)  # warm-up
        for _ in range(args.repeats):
            for stream in (True, False):
                row = rows.setdefault("streaming" if stream else "not streaming", {"alone": [], "after": []})
                row["alone"].append(answer_begins(c, model, stream))
                abandon(base, model, prompt, stream, args.abandon_after)
                row["after"].append(answer_begins(c, model, stream))
    result = {"prompt_tokens": len(prompt), "abandon_after_s": args.abandon_after, "serve_args": args.serve_args,
              "seconds": {mode: {k: [round(x, 3) for x in v] for k, v in row.items()} for mode, row in rows.items()}}
    print(f"long prompt {len(prompt)} tokens, abandoned after {args.abandon_after} s; "
          "seconds until the next short request's answer begins (median of the repeats):")
    for mode, row in rows.items():
        alone, after = sorted(row["alone"])[len(row["alone"]) // 2], sorted(row["after"])[len(row["after"]) // 2]
        print(f"  {mode:>13}: alone {alone:6.2f}   after the abandoned request {after:6.2f}   (+{after - alone:.2f})")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
