"""A long prompt's time to first text on `moaspec serve`: cores shared per decoder, or all to a prefill alone.

Starts two servers side by side, the same but for how they use the cores: ``--threads 1``
(every decoder always on its share: one thread each with ``--parallel 2`` on 2 cores) and the
default (a prefill that runs alone takes every core, chunk by chunk; `moaspec/cores.py`).
Both run without the prompt cache, so each request reads its whole prompt. For each prompt
length (the first N tokens of this repository's Markdown files, sent as token ids to
``/v1/completions``, streaming, 16 new tokens, greedy), the servers take turns, ``--repeats``
times: once with the request alone, and once with two such requests at the same time (where
the default must share, as ``--threads 1`` always does). Prints the median time to the first
text per length, setup and case (alone also to the end of the 16 tokens, which includes the
drafter's first pass over the prompt), and whether the answers agree.

    .venv/bin/python benchmarks/serve_prefill.py --lengths 1000,2000,4000 --output bench-out/serve-prefill.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx

from long_prompt import document_ids  # benchmarks/long_prompt.py, beside this script
from moaspec.models.loading import load_tokenizer
from moaspec.models.sources import resolve_model
from served import serving, sse_chunks


def first_text(url: str, model: str, ids: list[int]) -> tuple[float, str, float]:
    """Seconds to the first text of a streamed completion of ``ids``, the whole text, and seconds to its end."""
    body = {"model": model, "prompt": ids, "max_tokens": 16, "temperature": 0, "stream": True}
    with httpx.Client(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        first, text = None, ""
        with client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for chunk in sse_chunks(r):
                if piece := chunk["choices"][0].get("text"):
                    first = first or time.perf_counter() - t0
                    text += piece
    return first or 0.0, text, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1000,2000,4000", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=8771, help="the first server's port; the other gets the next")
    ap.add_argument("--output", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    tok = load_tokenizer(resolve_model(None))
    lengths = [int(x) for x in args.lengths.split(",")]
    setups = {"shared (--threads 1)": ["--threads", "1"], "all cores to a lone prefill": []}
    runs: dict[str, dict[str, dict[str, list[float]]]] = {}
    texts: dict[str, set[str]] = {}
    with ExitStack() as stack:
        urls = {}
        for k, (name, options) in enumerate(setups.items()):
            stack.enter_context(serving(args.port + k, ["--prompt-cache-mb", "0", *options]))
            urls[name] = f"http://127.0.0.1:{args.port + k}"
        models = {name: httpx.get(url + "/v1/models").json()["data"][0]["id"] for name, url in urls.items()}
        for name, url in urls.items():
            first_text(url, models[name], document_ids(tok, 64))  # warm-up
        pool = stack.enter_context(ThreadPoolExecutor(2))
        for n in lengths:
            ids = document_ids(tok, n)
            for _ in range(args.repeats):
                for name, url in urls.items():
                    cases = runs.setdefault(str(n), {}).setdefault(name, {"alone": [], "two at once": [],
                                                                          "alone, to the end": []})
                    t, text, end = first_text(url, models[name], ids)
                    cases["alone"].append(t)
                    cases["alone, to the end"].append(end)
                    both = list(pool.map(lambda _: first_text(url, models[name], ids), range(2)))
                    cases["two at once"] += [b[0] for b in both]
                    texts.setdefault(str(n), set()).update([text, *(b[1] for b in both)])
    print(f"{'prompt':>6} | {'case':>17} | " + " | ".join(f"{name:>27}" for name in setups) + " | same answers")
    summary = {}
    for n, by_setup in runs.items():
        for case in ("alone", "alone, to the end", "two at once"):
            med = {name: statistics.median(by_setup[name][case]) for name in setups}
            summary.setdefault(n, {})[case] = med
            print(f"{n:>6} | {case:>17} | " + " | ".join(f"{med[name]:>25.2f} s" for name in setups)
                  + f" | {'yes' if len(texts[n]) == 1 else 'NO'}")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"medians_s": summary, "runs_s": runs,
                                                 "same_answers": {n: len(t) == 1 for n, t in texts.items()}}, indent=2) + "\n")


if __name__ == "__main__":
    main()
