"""A conversation about a long document, on `moaspec serve` with and without its prompt cache, turn by turn.

Starts two servers, one with ``--prompt-cache-mb 0`` and one with the given size, and holds
the same conversation with both, interleaved turn by turn (only one server works at a time):
the first user message pastes the first ``--document-tokens`` tokens of this repository's
Markdown files and asks for a summary; each later turn asks a short question. Greedy.
Prints, per turn, the prompt's length, how many of its tokens the server reused, the time to
the first text, and whether both answers agree.

``--protocol openai`` (the default) asks the OpenAI chat API, streaming (reuse: its
``cached_tokens``); ``--protocol cs`` drafts here with the shipped MoA drafter and has the
server verify, one client (``SplitGeneration``) per server holding the conversation, one
session per turn (reuse: the session's ``cached_tokens``; the time to the first text includes
the prompt's state coming back, of which the client asks only what it does not hold from the
last turn; ``--fresh-client``: a new client every turn), optionally through an emulated
``--network`` profile; it also prints the bytes each turn received. ``--drafter``: another client drafter
(an EAGLE or independent one).

    .venv/bin/python benchmarks/serve_turns.py --document-tokens 3000 --output bench-out/serve-turns.json
    .venv/bin/python benchmarks/serve_turns.py --protocol cs --network 4g --document-tokens 3000 --output bench-out/cs-turns.json
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from long_prompt import document_ids  # benchmarks/long_prompt.py, beside this script
from moaspec.chat import encode_chat
from moaspec.clientserver.client import RemoteTarget, SplitGeneration
from moaspec.clientserver.netem import PROFILES, NetworkProxy
from moaspec.decoding import GenerationConfig
from moaspec.decoding.opening import stop_token_ids
from moaspec.drafters import load_drafter, shipped_drafter
from moaspec.models import load_model
from moaspec.models.loading import LoadedModel, load_tokenizer
from moaspec.models.sources import resolve_model
from served import serving, sse_chunks

QUESTIONS = ["Which command runs the tests?", "What is the drafter's acceptance length?", "Say that again in one line."]


def ask(client: httpx.Client, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
    """One streamed turn: the answer, seconds to its first text and to its end, and the usage."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    text, first, usage = "", None, {}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for chunk in sse_chunks(r):
            usage = chunk.get("usage") or usage
            if chunk["choices"] and (piece := chunk["choices"][0]["delta"].get("content")):
                first = first or time.perf_counter() - t0
                text += piece
    return {"text": text, "ttft_s": round(first or 0.0, 3), "total_s": round(time.perf_counter() - t0, 3),
            "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens")}


class SplitAsker:
    """Asks as a client–server chat does: the shipped MoA drafter here (or the one at ``drafter``), one client per
    server for the conversation (so a next turn begins from the drafter's state of the last), the server verifying."""

    def __init__(self, fresh: bool = False, drafter: str | None = None) -> None:
        self.fresh = fresh  # a new client every turn: it holds nothing of the last one
        self.target: LoadedModel = load_model(None)
        path = drafter or shipped_drafter(self.target)
        assert path is not None, "no MoA drafter ships for the default target"
        self.drafter = load_drafter(path, self.target)
        self.clients: dict[str, SplitGeneration] = {}

    def new_conversation(self) -> None:
        for gen in self.clients.values():
            gen.remote.shutdown()
        self.clients.clear()

    def __call__(self, url: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
        if url not in self.clients or self.fresh:
            self.clients[url] = SplitGeneration(self.drafter, self.target.tokenizer, RemoteTarget(url, timeout=60),
                                                stop_token_ids(self.target.model, self.target.tokenizer))
        ids = encode_chat(self.target.tokenizer, messages)
        r = self.clients[url].run(ids, GenerationConfig(max_new_tokens=max_tokens), self.target.cfg.max_position_embeddings)
        return {"text": r.text, "ttft_s": round(r.ttft_s, 3), "total_s": round(r.total_s, 3), "prompt_tokens": len(ids),
                "cached_tokens": r.cached_tokens, "carried_tokens": r.carried_tokens, "bytes_received": r.bytes_received}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--document-tokens", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-cache-mb", type=int, default=512)
    ap.add_argument("--port", type=int, default=8767, help="the server without a cache; the other gets the next port")
    ap.add_argument("--cache-first", action="store_true", help="the server with the cache answers each turn first")
    ap.add_argument("--protocol", choices=["openai", "cs"], default="openai",
                    help="the OpenAI chat API, or client-server speculative decoding (see above)")
    ap.add_argument("--network", default=None, help="cs: an emulated link between client and servers (lan, 4g, 5g)")
    ap.add_argument("--fresh-client", action="store_true", help="cs: a new client every turn (the server sends every "
                    "token's state again)")
    ap.add_argument("--drafter", default=None, help="cs: the client's drafter (default: the shipped MoA drafter), e.g. "
                    "moaspec/assets/drafters/smollm2-135m-instruct-eagle")
    ap.add_argument("--output", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    tok = load_tokenizer(resolve_model(None))
    document = tok.decode(document_ids(tok, args.document_tokens))  # type: ignore[attr-defined]
    first = f"Here is a document.\n\n{document}\n\nSummarise it in two sentences."
    setups = {"no cache": ["--prompt-cache-mb", "0"], "prompt cache": ["--prompt-cache-mb", str(args.prompt_cache_mb)]}
    if args.cache_first:
        setups = dict(reversed(setups.items()))
    split = SplitAsker(args.fresh_client, args.drafter) if args.protocol == "cs" else None
    turns: list[dict[str, dict]] = []
    with ExitStack() as stack:
        asks = {}
        for k, (name, options) in enumerate(setups.items()):
            stack.enter_context(serving(args.port + k, options))
            url = f"http://127.0.0.1:{args.port + k}"
            if split is not None and args.network:
                proxy = NetworkProxy(("127.0.0.1", args.port + k), PROFILES[args.network], seed=k).start()
                stack.callback(proxy.stop)
                url = proxy.url
            if split is not None:
                asks[name] = lambda messages, n, _url=url: split(_url, messages, n)
                continue
            c = stack.enter_context(httpx.Client(base_url=url, timeout=600))
            model = c.get("/v1/models").json()["data"][0]["id"]
            asks[name] = lambda messages, n, _c=c, _model=model: ask(_c, _model, messages, n)
        for asker in asks.values():
            asker([{"role": "user", "content": "Hello."}], 8)  # warm-up
        if split is not None:
            split.new_conversation()
        history = {name: [] for name in setups}  # type: dict[str, list[dict[str, str]]]
        for question in [first, *QUESTIONS]:
            turn = {}
            for name, asker in asks.items():
                history[name].append({"role": "user", "content": question})
                turn[name] = asker(history[name], args.max_tokens)
                history[name].append({"role": "assistant", "content": turn[name]["text"]})
            turns.append(turn)
    print(f"{args.protocol}{' over ' + args.network if args.network else ''}: a {args.document_tokens}-token document, then {len(QUESTIONS)} questions; greedy, "
          f"{args.max_tokens} tokens")
    print(f"{'turn':>4} {'prompt':>7} | {'no cache: ttft':>15} | {'prompt cache: reused':>21} {'ttft':>7} | same answer")
    for i, t in enumerate(turns, 1):
        a, b = t["no cache"], t["prompt cache"]
        print(f"{i:>4} {a['prompt_tokens']:>7} | {a['ttft_s']:>13.2f} s | {b['cached_tokens']:>21} {b['ttft_s']:>5.2f} s | "
              f"{'yes' if a['text'] == b['text'] else 'NO'}")
    if split is not None:
        print("bytes received per turn (no cache | prompt cache, client state carried):",
              ", ".join(f"{t['no cache']['bytes_received']} | {t['prompt cache']['bytes_received']} "
                        f"({t['prompt cache']['carried_tokens']} carried)" for t in turns))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"protocol": args.protocol, "network": args.network, "document_tokens": args.document_tokens, "turns": turns}, indent=2) + "\n")


if __name__ == "__main__":
    main()
