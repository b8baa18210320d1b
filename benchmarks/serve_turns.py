"""A conversation about a long document, on `moaspec serve` with and without its prompt cache, turn by turn.

Starts two servers, one with ``--prompt-cache-mb 0`` and one with the given size, and holds
the same conversation with both, interleaved turn by turn (only one server works at a time):
the first user message pastes the first ``--document-tokens`` tokens of this repository's
Markdown files and asks for a summary; each later turn asks a short question. Greedy,
streaming. Prints, per turn, the prompt's length, how many of its tokens the server reused
(OpenAI's ``cached_tokens``), the time to the first text, and whether both answers agree.

    .venv/bin/python benchmarks/serve_turns.py --document-tokens 3000 --output bench-out/serve-turns.json
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from long_prompt import document_ids  # benchmarks/long_prompt.py, beside this script
from moaspec.models.loading import load_tokenizer
from moaspec.models.sources import resolve_model
from served import serving

QUESTIONS = ["Which command runs the tests?", "What is the drafter's acceptance length?", "Say that again in one line."]


def ask(client: httpx.Client, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
    """One streamed turn: the answer, seconds to its first text and to its end, and the usage."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    text, first, usage = "", None, {}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if chunk["choices"] and (piece := chunk["choices"][0]["delta"].get("content")):
                first = first or time.perf_counter() - t0
                text += piece
    return {"text": text, "ttft_s": round(first or 0.0, 3), "total_s": round(time.perf_counter() - t0, 3),
            "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--document-tokens", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-cache-mb", type=int, default=512)
    ap.add_argument("--port", type=int, default=8767, help="the server without a cache; the other gets the next port")
    ap.add_argument("--cache-first", action="store_true", help="the server with the cache answers each turn first")
    ap.add_argument("--output", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    tok = load_tokenizer(resolve_model(None))
    document = tok.decode(document_ids(tok, args.document_tokens))  # type: ignore[attr-defined]
    first = f"Here is a document.\n\n{document}\n\nSummarise it in two sentences."
    setups = {"no cache": ["--prompt-cache-mb", "0"], "prompt cache": ["--prompt-cache-mb", str(args.prompt_cache_mb)]}
    if args.cache_first:
        setups = dict(reversed(setups.items()))
    turns: list[dict[str, dict]] = []
    with ExitStack() as stack:
        clients = {}
        for k, (name, options) in enumerate(setups.items()):
            stack.enter_context(serving(args.port + k, options))
            clients[name] = stack.enter_context(httpx.Client(base_url=f"http://127.0.0.1:{args.port + k}", timeout=600))
        models = {name: c.get("/v1/models").json()["data"][0]["id"] for name, c in clients.items()}
        for name, c in clients.items():
            ask(c, models[name], [{"role": "user", "content": "Hello."}], 8)  # warm-up
        history = {name: [] for name in setups}  # type: dict[str, list[dict[str, str]]]
        for question in [first, *QUESTIONS]:
            turn = {}
            for name, c in clients.items():
                history[name].append({"role": "user", "content": question})
                turn[name] = ask(c, models[name], history[name], args.max_tokens)
                history[name].append({"role": "assistant", "content": turn[name]["text"]})
            turns.append(turn)
    print(f"a {args.document_tokens}-token document, then {len(QUESTIONS)} questions; greedy, {args.max_tokens} tokens")
    print(f"{'turn':>4} {'prompt':>7} | {'no cache: ttft':>15} | {'prompt cache: reused':>21} {'ttft':>7} | same answer")
    for i, t in enumerate(turns, 1):
        a, b = t["no cache"], t["prompt cache"]
        print(f"{i:>4} {a['prompt_tokens']:>7} | {a['ttft_s']:>13.2f} s | {b['cached_tokens']:>21} {b['ttft_s']:>5.2f} s | "
              f"{'yes' if a['text'] == b['text'] else 'NO'}")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"document_tokens": args.document_tokens, "turns": turns}, indent=2) + "\n")


if __name__ == "__main__":
    main()
