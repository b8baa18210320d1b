"""After a disconnection: how much of the text a client wrote alone the target keeps once the server is back.

A client that loses its server goes on drafting alone; when the server answers again it
verifies that text and continues from the first disagreement (``SplitGeneration``). What a
user gets from the offline text is what survives that check, so this measures, per
SpecBench first turn and per drafter, through a real ``moaspec serve`` and a real client on
loopback (greedy, pinned one core each as ``bench-cs`` pins them):

- a client that is never cut answers ``max(--cut) + chain + 1 + max(--alone)`` tokens: the
  target's own greedy text, and the clock of a client that wrote nothing offline;
- for each cut point K (``--cut``, verified tokens) and offline length L (``--alone``): the
  link is cut once the client holds K verified tokens (v, a few more, where the
  verification that crossed K ended), the client writes exactly L tokens alone (drafting
  one at a time so that it stops at L), the link comes back and the client goes on until it
  holds v + L verified tokens.

Per run: **kept tokens**, how many of the L offline tokens the target accepted before the
first disagreement (counted on the real resynchronisation, and checked against the uncut
client's text); the expected number a target *sampling* at ``--temperature`` (0.7) would keep,
verifying the offline tokens as point masses: token i survives with the target's warped
probability p_i of it, so E[kept] = sum_k prod_{i<=k} p_i, exact, from one forward; the
offline text's perplexity under the target and its share of distinct 4-grams (a loop of
likely tokens has a low perplexity too), beside the target's own L tokens after the same
context; and the wall time from reconnection to v + L verified tokens against the uncut
client's time from v to v + L (**saved** = the difference; loopback, so only computation).

Prompts run category by category in turn (the first of each file, then the second, ...), so
that a stopped run covers every category alike; each finished prompt goes to the output at
once, and the same command resumes (``--table`` prints what a stopped run finished). MoA (``moa``) is compared prompt by prompt with every
other drafter on kept tokens by the two-sided sign test (ties dropped).

    nohup nice -n 19 .venv/bin/python benchmarks/disconnection.py --per-file 10 --threads 1 \\
        --output bench-out/kept-after-disconnection.json > kept.log 2>&1 &
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

import torch

import specbench_script  # beside this script
from compare_tau import sign_test  # beside this script
from moaspec.bench.journal import Journal
from moaspec.bench.methods import require_drafter
from moaspec.chat import chat_messages, encode_chat
from moaspec.clientserver.bench import ServerProcess, continuation_logits, perplexity_of, repeated_ngrams
from moaspec.clientserver.client import RemoteTarget, SplitGeneration
from moaspec.clientserver.netem import PROFILES, NetworkProxy
from moaspec.decoding import GenerationConfig, SamplingParams
from moaspec.decoding.prefill import common_prefix
from moaspec.decoding.sampling import probabilities
from moaspec.drafters.base import Drafter
from moaspec.drafters.eagle import EagleDrafter
from moaspec.drafters.independent import IndependentDrafter
from moaspec.drafters.moa import MoADrafter
from moaspec.errors import MoaspecError
from moaspec.fileio import atomic_write_text
from moaspec.models import LoadedModel
from moaspec.specbench import Question

REFERENCE = "moa"  # the method every other is compared with


def expected_kept(probs: Sequence[float]) -> float:
    """Expected offline tokens kept when verification keeps token i with probability ``probs[i]`` once every
    earlier one was kept: sum over k of prod_{i<=k} p_i (a point-mass draft x is accepted with p_target(x))."""
    total, alive = 0.0, 1.0
    for p in probs:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"a probability must lie in [0, 1], got {p}")
        alive *= p
        total += alive
    return total


def distinct_4grams(tokens: Sequence[int]) -> float:
    """The share of ``tokens``' 4-grams that occur in them only once so far: 1 for text that never repeats itself."""
    return 1.0 - repeated_ngrams(tokens, 4)


class CountingTarget(RemoteTarget):
    """The server's protocol, counting the tokens its verifications had the target read (drafts and the newest token)."""

    read = 0

    def verify(self, session: str, verified: int, draft: Sequence[int], *args: Any, **kwargs: Any) -> dict[str, Any]:
        answer = super().verify(session, verified, draft, *args, **kwargs)
        self.read += len(draft) + 1
        return answer


class TimedClient(SplitGeneration):
    """A client whose every verification is clocked; cut off once it holds ``cut_at`` verified tokens (None: never),
    and reconnected once it has written ``alone`` tokens alone.

    The offline text begins with the drafts that were in flight when the link died (at most
    2 × chain + 1); then the client drafts one token before each try to reach the server
    (``retry_every=1``), so that the offline text is exactly ``alone`` long when the link comes back.
    """

    def __init__(self, drafter: Drafter, target: LoadedModel, proxy: NetworkProxy, chain: int,
                 cut_at: int | None = None, alone: int = 0) -> None:
        self.proxy, self.cut_at, self.alone = proxy, cut_at, alone
        self.clock: list[Tick] = []  # after each verification
        self.cut = False
        self.written_alone: list[int] = []
        self.verified_at_cut = 0
        self.reconnected: Tick | None = None
        self.answer: list[int] = []
        # the cut resets connections, so the client notices it at once; no retries, so each try fails fast
        self.link = CountingTarget(proxy.url, timeout=60, retries=0)
        super().__init__(drafter, target.tokenizer, self.link, set(), draft_len=chain, retry_every=1)

    def tick(self) -> Tick:
        return Tick(time.perf_counter(), len(self.sink.tokens), self.link.calls, self.link.read)

    def _keep(self, *args: Any, **kwargs: Any) -> None:
        super()._keep(*args, **kwargs)
        self.clock.append(self.tick())
        if self.cut_at is not None and not self.cut and len(self.sink.tokens) >= self.cut_at:
            self.proxy.cut()
            self.cut = True

    def _resync(self) -> bool:
        """Bring the link back once the offline text is ``alone`` long (it grows by one token between tries)."""
        if self.cut and self.reconnected is None and len(self.tokens) - self.verified >= self.alone:
            self.written_alone = self.tokens[self.verified:]
            self.verified_at_cut = len(self.sink.tokens)
            self.proxy.restore()
            self.reconnected = self.tick()
        return super()._resync()


@dataclass(frozen=True)
class Tick:
    """Where a client stood at one moment: the clock, its verified tokens, its server calls, the tokens it had the
    target read."""

    at: float
    verified: int
    calls: int
    read: int

    def until(self, later: Tick) -> dict[str, float]:
        """Seconds, server calls and target tokens read from this moment to ``later``."""
        return {"s": round(later.at - self.at, 4), "calls": later.calls - self.calls, "read": later.read - self.read}


def first_at(clock: Sequence[Tick], n: int) -> Tick:
    """When the client first held ``n`` verified tokens."""
    for tick in clock:
        if tick.verified >= n:
            return tick
    raise MoaspecError(f"the client never held {n} verified tokens (at most {clock[-1].verified if clock else 0})")


def run_client(target: LoadedModel, drafter: Drafter, proxy: NetworkProxy, prompt: Sequence[int], chain: int,
               budget: int, cut_at: int | None = None, alone: int = 0) -> TimedClient:
    """One greedy answer of ``budget`` tokens through ``proxy`` (cut and reconnected as :class:`TimedClient` says)."""
    client = TimedClient(drafter, target, proxy, chain, cut_at, alone)
    try:
        result = client.run(prompt, GenerationConfig(max_new_tokens=budget, ignore_eos=True),
                            target.cfg.max_position_embeddings)
    finally:
        client.link.shutdown()
    if cut_at is not None and client.reconnected is None:
        raise MoaspecError(f"the client never wrote {alone} tokens alone after the cut at {cut_at}")
    if cut_at is not None and len(client.written_alone) != alone:
        raise MoaspecError(f"the link died with drafts in flight, {len(client.written_alone)} tokens of offline text "
                           f"at the first try to reach the server: write more than {alone} alone")
    if result.unverified:
        raise MoaspecError(f"{result.unverified} tokens were left unverified after the reconnection")
    client.answer = result.token_ids
    return client


def score_prefixes(target: LoadedModel, context: Sequence[int], text: Sequence[int], lengths: Sequence[int],
                   temperature: float) -> dict[str, dict[str, float]]:
    """For each first ``n`` tokens of ``text`` after ``context``: perplexity under the target, distinct 4-grams, and
    the tokens a target sampling at ``temperature`` is expected to keep of them verified as point masses. One
    forward: the target is causal, so the rows of the first ``n`` tokens are those of ``n`` tokens alone."""
    logits = continuation_logits(target, context, text)
    p = probabilities(logits, SamplingParams(temperature))[torch.arange(len(text)), torch.tensor(list(text))]
    p = p.clamp(0, 1).tolist()
    return {str(n): {"perplexity": round(perplexity_of(logits[:n], text[:n]), 4),
                     "distinct_4grams": round(distinct_4grams(text[:n]), 4),
                     f"expected_kept_t{temperature:g}": round(expected_kept(p[:n]), 4)} for n in lengths}


def study_prompt(target: LoadedModel, drafter: Drafter, upstream: tuple[str, int], prompt: Sequence[int],
                 cuts: Sequence[int], alones: Sequence[int], chain: int, temperature: float) -> dict[str, Any]:
    """Every cut point and offline length for one prompt and one drafter: the uncut client first, then each cut.

    One cut run per cut point writes the longest offline text; a client that wrote fewer tokens alone wrote
    its first ones (drafting is deterministic), so kept tokens, perplexity, distinct 4-grams and expected
    kept tokens of every shorter length come from it. The time, calls and tokens read after reconnection are
    those of the longest.
    """
    longest = max(alones)
    proxy = NetworkProxy(upstream, PROFILES["none"]).start()
    try:
        base = run_client(target, drafter, proxy, prompt, chain, max(cuts) + chain + 1 + longest)
        out: dict[str, Any] = {}
        for k in cuts:
            cut = run_client(target, drafter, proxy, prompt, chain, k + chain + 1 + longest, cut_at=k, alone=longest)
            assert cut.reconnected is not None
            v, alone = cut.verified_at_cut, cut.written_alone
            if base.answer[:v] != cut.answer[:v]:
                raise MoaspecError("the cut client's verified text differs from the uncut one's before the cut")
            context, own = [*prompt, *cut.answer[:v]], base.answer[v : v + longest]
            mine, theirs = (score_prefixes(target, context, t, alones, temperature) for t in (alone, own))
            out[str(k)] = {
                "verified_before_cut": v, "alone": alone,
                "after_reconnection": cut.reconnected.until(first_at(cut.clock, v + longest)),
                "uncut": first_at(base.clock, v).until(first_at(base.clock, v + longest)),
                **{str(n): {"kept": common_prefix(alone[:n], cut.answer[v:]),  # what the resynchronisation kept
                            "kept_by_own_text": common_prefix(alone[:n], own),  # the same, off the uncut client's text
                            **mine[str(n)], "target": theirs[str(n)]} for n in alones}}
        return out
    finally:
        proxy.stop()


def interleaved(questions: list[Question]) -> list[Question]:
    """The first question of every category, then the second of every category, ...: a stopped run is balanced."""
    by: dict[str, list[Question]] = {}
    for q in questions:
        by.setdefault(q.category, []).append(q)
    return [q for row in zip_longest(*by.values()) for q in row if q is not None]


def summarize(rows: list[dict[str, Any]], methods: Sequence[str], cuts: Sequence[int], alones: Sequence[int],
              temperature: float) -> dict[str, Any]:
    """Per method and (cut, offline length): means over the prompts; MoA against each other method by sign tests on
    kept tokens, per cell and on each prompt's kept tokens summed over every cell."""
    key_t = f"expected_kept_t{temperature:g}"
    out: dict[str, Any] = {"prompts": len(rows), "cells": {}, "sign_tests": {}}

    def cell(m: str, k: int, n: int) -> list[dict[str, Any]]:
        return [r["methods"][m][str(k)][str(n)] for r in rows]

    for m in methods:
        for k in cuts:
            cuts_of = [r["methods"][m][str(k)] for r in rows]
            if not cuts_of:
                continue
            after = [c["after_reconnection"] for c in cuts_of]
            uncut = [c["uncut"] for c in cuts_of]
            saved = [u["s"] - a["s"] for a, u in zip(after, uncut)]
            out["cells"].setdefault(m, {})[f"{k}/{max(alones)} reconnection"] = {
                "saved_s_mean": round(statistics.mean(saved), 4), "saved_s_median": round(statistics.median(saved), 4),
                "after_s_mean": round(statistics.mean(a["s"] for a in after), 4),
                "uncut_s_mean": round(statistics.mean(u["s"] for u in uncut), 4),
                "calls_after_mean": round(statistics.mean(a["calls"] for a in after), 2),
                "calls_uncut_mean": round(statistics.mean(u["calls"] for u in uncut), 2),
                "read_after_mean": round(statistics.mean(a["read"] for a in after), 2),
                "read_uncut_mean": round(statistics.mean(u["read"] for u in uncut), 2)}
            for n in alones:
                runs = cell(m, k, n)
                out["cells"][m][f"{k}/{n}"] = {
                    "kept": round(statistics.mean(r["kept"] for r in runs), 3),
                    "fraction_kept": round(statistics.mean(r["kept"] for r in runs) / n, 4),
                    "kept_median": statistics.median(r["kept"] for r in runs),
                    "kept_disagrees_with_own_text": sum(r["kept"] != r["kept_by_own_text"] for r in runs),
                    key_t: round(statistics.mean(r[key_t] for r in runs), 3),
                    "perplexity_geomean": round(math.exp(statistics.mean(math.log(r["perplexity"]) for r in runs)), 3),
                    "distinct_4grams": round(statistics.mean(r["distinct_4grams"] for r in runs), 4),
                    "target_perplexity_geomean": round(math.exp(statistics.mean(
                        math.log(r["target"]["perplexity"]) for r in runs)), 3),
                    "target_distinct_4grams": round(statistics.mean(r["target"]["distinct_4grams"] for r in runs), 4)}
    if REFERENCE in methods:
        for other in (m for m in methods if m != REFERENCE):
            pairs = {f"{k}/{n}": [(a["kept"], b["kept"]) for a, b in zip(cell(REFERENCE, k, n), cell(other, k, n))]
                     for k in cuts for n in alones}
            pairs["all cells"] = [tuple(sum(r["methods"][m][str(k)][str(n)]["kept"] for k in cuts for n in alones)
                                        for m in (REFERENCE, other)) for r in rows]
            tests = {}
            for name, matched in pairs.items():
                more, fewer = sum(a > b for a, b in matched), sum(a < b for a, b in matched)
                tests[name] = {"moa_more": more, "moa_fewer": fewer, "equal": len(matched) - more - fewer,
                               "p": round(sign_test(more, fewer), 5)}
            out["sign_tests"][f"{REFERENCE} vs {other}"] = tests
    return out


def table(summary: dict[str, Any], temperature: float) -> str:
    """The summary as markdown: kept tokens and the texts' figures per method and cell, then the time after
    reconnection, then the sign tests."""
    key_t = f"expected_kept_t{temperature:g}"
    lines = [f"| method | cut / alone | kept | fraction kept | expected kept, T = {temperature:g} "
             "| distinct 4-grams (target's) | perplexity (target's) |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    times = ["| method | cut / alone | saved (mean / median) | after reconnection | uncut | calls after / uncut "
             "| tokens read after / uncut |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for m, cells in summary["cells"].items():
        for name, c in cells.items():
            if name.endswith("reconnection"):
                times.append(f"| {m} | {name.split()[0]} | {c['saved_s_mean'] * 1000:+.0f} / {c['saved_s_median'] * 1000:+.0f} ms "
                             f"| {c['after_s_mean']:.2f} s | {c['uncut_s_mean']:.2f} s | {c['calls_after_mean']:.1f} / "
                             f"{c['calls_uncut_mean']:.1f} | {c['read_after_mean']:.1f} / {c['read_uncut_mean']:.1f} |")
            else:
                lines.append(f"| {m} | {name} | {c['kept']:.2f} | {c['fraction_kept']:.1%} | {c[key_t]:.2f} | "
                             f"{c['distinct_4grams']:.0%} ({c['target_distinct_4grams']:.0%}) | "
                             f"{c['perplexity_geomean']:.2f} ({c['target_perplexity_geomean']:.2f}) |")
    tests = [f"{pair}, kept tokens (MoA more / fewer): " + "; ".join(
        f"{name} {t['moa_more']}/{t['moa_fewer']} (p = {t['p']:.3g})" for name, t in cells.items())
        for pair, cells in summary["sign_tests"].items()]
    return "\n".join([*lines, "", *times, "", *tests])


def positive_list(text: str, what: str) -> list[int]:
    """``"32,64"`` → ``[32, 64]``; a clear error for anything but positive integers."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"disconnection: {what} takes a comma list of positive token counts, got {text!r}")
    return values


def main() -> None:
    ap = specbench_script.parser(__doc__, per_file=10)
    ap.add_argument("--cut", default="32,64", help="cut the link after K verified tokens (comma list)")
    ap.add_argument("--alone", default="32,64,128", help="tokens the client writes alone before the link returns")
    ap.add_argument("--chain", type=int, default=2, help="drafts per verification (the client's default chain)")
    ap.add_argument("--temperature", type=float, default=0.7, help="for the expected kept tokens of a sampling target")
    ap.add_argument("--eagle-drafter", default=None, help="EAGLE drafter (default: the one shipped beside MoA)")
    ap.add_argument("--tli-drafter", default=None, help="a MoA drafter with Target Layer Inference (N > 0)")
    ap.add_argument("--independent-drafter", default=None, help="an independent drafter (moaspec train --kind independent)")
    ap.add_argument("--port", type=int, default=8791)
    ap.add_argument("--table", action="store_true",
                    help="print the table of the prompts finished so far in --output, and run nothing")
    args = ap.parse_args()
    cuts, alones = positive_list(args.cut, "--cut"), positive_list(args.alone, "--alone")
    if args.chain < 1 or not 0 < args.temperature:
        raise SystemExit("disconnection: --chain must be >= 1 and --temperature > 0")
    if not args.output:
        raise SystemExit("disconnection: --output is needed (each finished prompt is written there)")
    if args.table:  # a run stopped at a deadline still reports what it finished
        done = json.loads(Path(args.output).read_text(encoding="utf-8"))
        print(f"{done['summary']['prompts']} prompts, finished: {done['finished']}")
        print(table(done["summary"], done["setup"]["temperature"]))
        return
    target, moa_path = specbench_script.target_and_drafter_path(args)
    drafters: dict[str, Drafter] = {"moa": require_drafter(moa_path, MoADrafter, "moa", target),
                                    "eagle2": require_drafter(args.eagle_drafter, EagleDrafter, "eagle2", target)}
    remote = [moa_path]
    if args.tli_drafter:
        tli = require_drafter(args.tli_drafter, MoADrafter, "moa-tli", target)
        drafters[f"moa-tli{tli.cfg.tli_layers}"] = tli
        remote.append(args.tli_drafter)
    if args.independent_drafter:
        drafters["independent"] = require_drafter(args.independent_drafter, IndependentDrafter, "independent", target)
    questions = interleaved(specbench_script.questions(args))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    setup = {"cuts": cuts, "alones": alones, "chain": args.chain, "temperature": args.temperature,
             "methods": list(drafters), "drafters": {"moa": moa_path, "eagle2": args.eagle_drafter,
                                                     "tli": args.tli_drafter, "independent": args.independent_drafter},
             "questions": [[q.category, str(q.question_id)] for q in questions], "link": "loopback, no emulated delay"}
    cores = sorted(os.sched_getaffinity(0))
    pinned = len(cores) >= 2
    setup["pinned"] = f"client on core {cores[0]}, server on core {cores[1]}" if pinned else "not pinned (one core)"
    journal = Journal(output.with_suffix(".partial.jsonl"), setup, "disconnection", f"{len(questions)} prompts")
    server = ServerProcess(args.port, None, remote[0], cores[1] if pinned else None, remote[1:])
    if pinned:
        os.sched_setaffinity(0, {cores[0]})
    torch.set_num_threads(args.threads)

    def write(rows: list[dict[str, Any]], final: bool) -> dict[str, Any]:
        summary = summarize(rows, list(drafters), cuts, alones, args.temperature)
        atomic_write_text(output, json.dumps({"setup": setup, "finished": final, "summary": summary, "rows": rows},
                                             indent=1))
        return summary

    rows: list[dict[str, Any]] = []
    try:
        warm = encode_chat(target.tokenizer, chat_messages(questions[0].turns[0]))
        warm_link = NetworkProxy(("127.0.0.1", args.port), PROFILES["none"]).start()
        for d in drafters.values():  # first-call allocations on both ends, before anything is timed
            run_client(target, d, warm_link, warm, args.chain, 8)
        warm_link.stop()
        for i, q in enumerate(questions):
            key = f"{q.category}/{q.question_id}"
            row = journal.done.get(key)
            if row is None:
                prompt = encode_chat(target.tokenizer, chat_messages(q.turns[0]))
                t0 = time.perf_counter()
                row = {"category": q.category, "question_id": str(q.question_id), "prompt_tokens": len(prompt),
                       "load_average": round(os.getloadavg()[0], 2), "methods": {
                           m: study_prompt(target, d, ("127.0.0.1", args.port), prompt, cuts, alones, args.chain,
                                           args.temperature) for m, d in drafters.items()}}
                row["wall_s"] = round(time.perf_counter() - t0, 1)
                journal.record(key, row)
                print(f"[{i + 1}/{len(questions)}] {key} in {row['wall_s']} s (load {row['load_average']}): " + ", ".join(
                    f"{m} kept {[c[str(n)]['kept'] for c in r.values() for n in alones]}"
                    for m, r in row["methods"].items()), flush=True)
            rows.append(row)
            write(rows, False)
    finally:
        server.close()
    summary = write(rows, True)
    journal.finish()
    print(table(summary, args.temperature))


if __name__ == "__main__":
    try:
        main()
    except MoaspecError as exc:
        sys.exit(f"disconnection: {exc}")
