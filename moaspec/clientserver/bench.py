"""``moaspec bench-cs``: client–server decoding under emulated network profiles, and after a disconnection.

The server is ``moaspec serve`` in its own process (plain decoding for the API
baseline; the MoA drafter's server half for sessions); the client runs here; the
emulated link sits between them. Where the machine has two cores or more, the server
is pinned to one and the client to another, so that they never share a CPU.

Methods:
  ``moa``     the MoA drafter on the client, the target on the server (``/cs/v1``)
  ``moa-pld`` the same, with prompt lookup's copies sent instead of the drafter's chain where they exist
  ``eagle2``  an EAGLE drafter on the client, fed the target's hidden states by the server
  ``independent``  an independent small model on the client (classic speculative decoding): no state travels
  ``moa-tree`` the same, sending EAGLE-2 dynamic draft trees instead of chains
  ``api``     the server decodes alone and streams tokens (``/v1/chat/completions``)
Every method decodes greedily, or samples with the same temperature and top-p (each
prompt's seed derived from the run's, the same for every method); the disconnection
study stays greedy, since it scores the continuation against the target's greedy one.

Per profile and method, ``summary.json`` holds ``tokens_per_s``, ``ttft_s``,
``server_calls_per_100_tokens`` and ``bytes_per_token`` (request and response bodies).
The ``disconnect`` section (per drafter: moa-pld's client writes alone exactly as moa's
does) cuts the link once K tokens are verified, lets the client
continue alone for C tokens, and scores that continuation by its perplexity under the
target and by the length of its exact match with the target's own greedy continuation.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import torch

from moaspec.bench.journal import Journal
from moaspec.bench.methods import for_prompt
from moaspec.chat import chat_messages, encode_chat
from moaspec.childproc import child
from moaspec.clientserver.client import RemoteTarget, SplitGeneration
from moaspec.clientserver.netem import NetworkProxy, Profile
from moaspec.decoding import GenerationConfig, SamplingParams, generate
from moaspec.decoding.opening import stop_token_ids
from moaspec.decoding.prefill import common_prefix
from moaspec.decoding.tree import TreeShape
from moaspec.drafters.base import Drafter
from moaspec.drafters.moa import MoADrafter
from moaspec.errors import MoaspecError
from moaspec.fileio import atomic_write_text
from moaspec.models.loading import LoadedModel
from moaspec.progress import progress_bar
from moaspec.specbench import Question

METHODS = ("moa", "moa-pld", "moa-tree", "eagle2", "independent", "api")
VARIANTS = {"moa-pld": ("moa", "lookup"), "moa-tree": ("moa", "tree")}  # method → (its drafter's method, what it adds)


class ServerProcess:
    """``moaspec serve`` as a child process on its own core, until closed."""

    def __init__(self, port: int, model: str | None, drafter: str | None, core: int | None,
                 remote_drafters: Sequence[str] = ()) -> None:
        # no prompt cache: the api baseline answers each question once per profile, and must not read the
        # prompts it read under the previous profile for free (the client-server methods have no such cache)
        cmd = [sys.executable, "-m", "moaspec.cli", "serve", "--port", str(port), "--no-draft", "--threads", "1",
               "--log-level", "warning", "--parallel", "1", "--prompt-cache-mb", "0"]
        cmd += ["--model", model] if model else []
        cmd += ["--drafter", drafter] if drafter else []
        for path in remote_drafters:
            cmd += ["--remote-drafter", path]
        if core is not None:
            cmd = ["taskset", "-c", str(core), *cmd]
        self.proc = child(cmd, stderr=subprocess.PIPE, text=True)
        line = self.proc.stderr.readline()  # type: ignore[union-attr]
        if "serving" not in line:
            self.proc.kill()  # whatever it printed instead, it must not outlive this failure
            said = (line + self.proc.stderr.read()[-500:]).strip().removeprefix("moaspec: error: ")  # type: ignore[union-attr]
            self.proc.wait(30)
            raise MoaspecError(f"the server did not start on port {port}: {said}")
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _api(url: str, prompt: str, max_new: int, sampling: SamplingParams = SamplingParams()) -> dict[str, Any]:
    """One streamed chat completion, timed from the request; counts bytes on the wire (bodies)."""
    body: dict[str, Any] = {"model": "default", "messages": [{"role": "user", "content": prompt}],
                            "temperature": sampling.temperature, "max_tokens": max_new, "stream": True,
                            "stream_options": {"include_usage": True}}
    if not sampling.greedy:
        body.update(top_p=sampling.top_p, seed=sampling.seed)
    t0 = time.perf_counter()
    ttft, received, tokens, calls = None, 0, 0, 0
    with httpx.Client(timeout=600) as http:
        model = http.get(url + "/v1/models").json()["data"][0]["id"]
        body["model"] = model
        t0 = time.perf_counter()
        with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            for line in resp.iter_lines():
                received += len(line) + 1
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0].get("finish_reason"):
                    calls = chunk["moaspec"]["target_calls"]
    total = time.perf_counter() - t0
    return {"tokens": tokens, "total_s": total, "ttft_s": ttft or total, "server_calls": calls,
            "bytes": received + len(json.dumps(body))}


def _split(target: LoadedModel, drafter: Drafter, url: str, ids: Sequence[int], max_new: int, chain: int,
           fmt: str, lookup: int = 0, tree: TreeShape | None = None, confidence: float = 0.0,
           sampling: SamplingParams = SamplingParams()) -> dict[str, Any]:
    remote = RemoteTarget(url, timeout=30)
    gen = SplitGeneration(drafter, target.tokenizer, remote, stop_token_ids(target.model, target.tokenizer),
                          draft_len=chain, fmt=fmt, lookup=lookup, tree=tree, confidence=confidence)
    r = gen.run(ids, GenerationConfig(max_new_tokens=max_new, sampling=sampling), target.cfg.max_position_embeddings)
    remote.shutdown()
    return {"tokens": len(r.token_ids), "total_s": r.total_s, "ttft_s": r.ttft_s, "server_calls": r.server_calls,
            "bytes": r.bytes_sent + r.bytes_received, "tau": r.tau, "token_ids": r.token_ids}


def _aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(r["tokens"] for r in rows)
    out = {"questions": len(rows), "new_tokens": tokens,
           "tokens_per_s": round(tokens / sum(r["total_s"] for r in rows), 3),
           "ttft_s": round(sum(r["ttft_s"] for r in rows) / len(rows), 4),
           "server_calls_per_100_tokens": round(100 * sum(r["server_calls"] for r in rows) / max(1, tokens), 2),
           "bytes_per_token": round(sum(r["bytes"] for r in rows) / max(1, tokens), 1)}
    if all("tau" in r for r in rows):
        out["tau"] = round(sum(r["tau"] for r in rows) / len(rows), 4)
    return out


def continuation_logits(target: LoadedModel, context: Sequence[int], continuation: Sequence[int]) -> torch.Tensor:
    """The target's logits ``[len(continuation), V]`` (fp32) at each token of ``continuation`` after ``context``:
    row ``i`` scores ``continuation[i]``. One forward: every figure of a continuation comes from these rows."""
    ids = torch.tensor([list(context) + list(continuation)])
    cache = target.model.new_cache(ids.shape[1])
    with torch.inference_mode():
        return target.model(ids, cache, logits_at=slice(len(context) - 1, ids.shape[1] - 1)).logits[0].float()


def perplexity_of(logits: torch.Tensor, continuation: Sequence[int]) -> float:
    """exp(mean negative log-likelihood) of ``continuation`` under ``logits`` (:func:`continuation_logits`'s rows)."""
    nll = torch.nn.functional.cross_entropy(logits[: len(continuation)], torch.tensor(list(continuation)))
    return math.exp(float(nll))


def perplexity(target: LoadedModel, context: Sequence[int], continuation: Sequence[int]) -> float:
    """exp(mean negative log-likelihood) of ``continuation`` after ``context`` under the target."""
    return perplexity_of(continuation_logits(target, context, continuation), continuation)


def repeated_ngrams(tokens: Sequence[int], n: int = 4) -> float:
    """The share of ``tokens``' n-grams that already occurred earlier in them: 0 for text that never repeats
    itself, near 1 for a loop. A low perplexity alone does not tell a faithful continuation from a loop of
    likely tokens; this does."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams) if grams else 0.0


def _disconnect(target: LoadedModel, drafter: Drafter, upstream: tuple[str, int], profile: Profile,
                ids: Sequence[int], after: int, cont: int, chain: int, fmt: str, seed: int) -> dict[str, Any]:
    proxy = NetworkProxy(upstream, profile, seed).start()
    # the cut resets connections, so the client notices it at once; the timeout only guards a loaded
    # server's prefill (5 s failed the study's start on a busy machine)
    remote = RemoteTarget(proxy.url, timeout=30, retries=0)
    gen = SplitGeneration(drafter, target.tokenizer, remote, set(), draft_len=chain, fmt=fmt,
                          on_piece=lambda text, kind: proxy.cut() if len(gen.sink.tokens) >= after else None)
    try:
        r = gen.run(ids, GenerationConfig(max_new_tokens=after + chain + 1 + cont, ignore_eos=True),
                    target.cfg.max_position_embeddings)
    finally:
        remote.shutdown()
        proxy.stop()
    verified = r.token_ids[: len(r.token_ids) - r.unverified]
    alone = r.token_ids[len(verified):][:cont]
    if len(alone) < cont:
        raise MoaspecError("the link was cut too late to leave a full continuation; lower the disconnect point")
    context = list(ids) + verified
    reference = generate(target.model, target.tokenizer, context,
                         GenerationConfig(max_new_tokens=cont, ignore_eos=True)).token_ids
    return {"verified_before_cut": len(verified), "perplexity": perplexity(target, context, alone),
            "target_greedy_perplexity": perplexity(target, context, reference),
            "exact_match_tokens": common_prefix(alone, reference),
            "repeated_4grams": repeated_ngrams(alone), "target_greedy_repeated_4grams": repeated_ngrams(reference)}


def run_bench_cs(target: LoadedModel, drafters: dict[str, Drafter], questions: list[Question], profiles: list[Profile],
                 methods: Sequence[str], max_new: int, output: Path, *, chain: int = 4, confidence: float = 0.0,
                 lookup: int = 10,
                 fmt: str = "fp16", tree: TreeShape = TreeShape(),
                 disconnect_after: int = 32, continue_tokens: int = 128, port: int = 8790,
                 model_spec: str | None = None, drafter_path: str | None = None,
                 more_moa: Sequence[tuple[str, Drafter]] = (), progress: bool = True,
                 settings: dict[str, Any] | None = None, sampling: SamplingParams = SamplingParams()) -> dict[str, Any]:
    """``drafters`` maps each drafter method (moa, eagle2, independent) to its drafter; api is server-side.

    Every question's runs (all methods, one profile) and every disconnection study go to
    ``output/runs.partial.jsonl`` as they finish (:class:`moaspec.bench.journal.Journal`):
    the same call with the same ``settings`` (the options that shape the drafters)
    resumes an interrupted run.

    ``lookup`` is the most prompt-lookup drafts per verification of ``moa-pld``; ``tree`` the
    dynamic trees ``moa-tree`` sends instead of chains (the disconnection study keeps chains
    of ``chain``, whatever ``confidence`` the timed chains end at).
    ``more_moa`` (path, drafter): further MoA drafters, e.g. other N, that the
    disconnection study runs too (labelled by N, like the main one). ``sampling``: how
    the timed runs pick tokens (greedy by default; top-k is refused, as the API refuses it).
    """
    if sampling.top_k:
        raise MoaspecError("bench-cs samples with temperature and top-p only: its api baseline (the OpenAI API) has no top-k")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise MoaspecError(f"unknown method(s) {', '.join(unknown)} for bench-cs; available: {', '.join(METHODS)}")
    clients: dict[str, tuple[Drafter, int, TreeShape | None]] = {}  # method → (its drafter, its lookup, its tree)
    for m in methods:
        if m != "api":
            base, adds = VARIANTS.get(m, (m, ""))
            clients[m] = (drafters[base], lookup if adds == "lookup" else 0, tree if adds == "tree" else None)
    drafters = {m: d for m, d in drafters.items() if m in {VARIANTS.get(c, (c, ""))[0] for c in clients}}
    cores = sorted(os.sched_getaffinity(0))
    pinned = len(cores) >= 2
    upstream = ("127.0.0.1", port)
    prompts = [(q, encode_chat(target.tokenizer, chat_messages(q.turns[0]))) for q in questions]
    summary: dict[str, Any] = {"profiles": {}, "disconnect": {}, "setup": {
        "questions": len(questions), "max_new_tokens": max_new, "chain": chain, "draft_confidence": confidence,
        "state_format": fmt,
        **({} if sampling.greedy else {"sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                                    "seed": sampling.seed}}),
        **({"tree": {"depth": tree.depth, "top_k": tree.top_k, "total": tree.total}} if "moa-tree" in methods else {}),
        **({"moa_drafter": drafter_path, "moa_tli_layers": drafters["moa"].cfg.tli_layers}  # type: ignore[attr-defined]
           if "moa" in drafters else {}),
        **({"lookup": lookup} if "moa-pld" in methods else {}),
        "pinned": f"client on core {cores[0]}, server on core {cores[1]}" if pinned else "not pinned (one core)",
        "profiles": {p.name: p.describe() for p in profiles}}}
    output.mkdir(parents=True, exist_ok=True)
    studied = [*drafters.items(), *(("moa", d) for _, d in more_moa)] if disconnect_after > 0 else []
    run = {"setup": summary["setup"], "methods": list(methods), "settings": settings or {},
           "questions": [[q.category, str(q.question_id)] for q in questions],
           "disconnect": [disconnect_after, continue_tokens, [m for m, _ in studied]]}
    journal = Journal(output / "runs.partial.jsonl", run, "moaspec bench-cs",
                      f"{(len(profiles) + len(studied)) * len(prompts)} runs (profile or disconnection study × question)")
    resumed = len(journal.done)
    # the server starts last: nothing between here and the `finally` that stops it can fail on input
    server = ServerProcess(port, model_spec, drafter_path, cores[1] if pinned else None, [p for p, _ in more_moa])
    if pinned:
        os.sched_setaffinity(0, {cores[0]})
        torch.set_num_threads(1)
    try:
        # warm both ends (first-call allocations) before timing anything
        for d, n, shape in clients.values():
            _split(target, d, server.url, prompts[0][1], 8, chain, fmt, n, shape, confidence)
        _api(server.url, questions[0].turns[0], 8)
        bar = progress_bar(total=len(profiles) * len(methods) * len(prompts), disable=not progress, desc="bench-cs")
        for profile in profiles:
            todo = [i for i in range(len(prompts)) if f"{profile.name}/{i}" not in journal.done]
            bar.update(len(methods) * (len(prompts) - len(todo)))
            # a resumed profile's link draws its delays afresh from the seed: the same profile, not the same draws
            proxy = NetworkProxy(upstream, profile, seed=0).start() if todo else None
            try:
                for i in todo:
                    q, ids = prompts[i]
                    params = for_prompt(sampling, ids)
                    rows: dict[str, dict[str, Any]] = {}
                    for m in methods:  # back to back per question, so drift hits both alike
                        assert proxy is not None
                        if m in clients:
                            drafter, n, shape = clients[m]
                            rows[m] = _split(target, drafter, proxy.url, ids, max_new, chain, fmt, n, shape, confidence,
                                             params)
                            rows[m].pop("token_ids")
                        else:
                            rows[m] = _api(proxy.url, q.turns[0], max_new, params)
                        bar.update()
                    journal.record(f"{profile.name}/{i}", rows)
            finally:
                if proxy is not None:
                    proxy.stop()
            summary["profiles"][profile.name] = {
                m: _aggregate([journal.done[f"{profile.name}/{i}"][m] for i in range(len(prompts))]) for m in methods}
        bar.close()
        for m, d in studied:
            label = f"N={d.cfg.tli_layers}" if isinstance(d, MoADrafter) else "chain"
            results = [journal.done.get(f"disconnect/{m}/{label}/{i}") or journal.record(
                           f"disconnect/{m}/{label}/{i}",
                           _disconnect(target, d, upstream, profiles[0], ids, disconnect_after, continue_tokens, chain, fmt, i))
                       for i, (_, ids) in enumerate(progress_bar(iterable=prompts, disable=not progress, desc=f"disconnect {m}"))]
            summary["disconnect"].setdefault(m, {})[label] = {
                **{key: _mean(results, key, digits) for key, digits in DISCONNECT_MEANS}, "per_question": results}
        if studied:
            summary["disconnect"].update({"after_tokens": disconnect_after, "continue_tokens": continue_tokens})
    finally:
        server.close()
    summary["resumed_runs"] = resumed
    summary["settings"] = settings or {}
    atomic_write_text(output / "summary.json", json.dumps(summary, indent=2) + "\n")
    journal.finish()
    return summary


# the disconnection study's figures, averaged over the questions (and the digits they are rounded to)
DISCONNECT_MEANS = (("perplexity", 3), ("target_greedy_perplexity", 3), ("exact_match_tokens", 2),
                    ("repeated_4grams", 3), ("target_greedy_repeated_4grams", 3))


def _mean(results: list[dict[str, Any]], key: str, digits: int) -> float | None:
    """The mean of ``key`` over the questions that have it (a journal from before a figure existed lacks it)."""
    values = [r[key] for r in results if key in r]
    return round(sum(values) / len(values), digits) if values else None


def table(summary: dict[str, Any]) -> str:
    lines = ["profile  method       tokens/s  ttft_s  server calls/100 tok  bytes/token  tau"]
    for name, methods in summary["profiles"].items():
        for m, s in methods.items():
            lines.append(f"{name:<8} {m:<12} {s['tokens_per_s']:>8.2f}  {s['ttft_s']:>6.3f}  {s['server_calls_per_100_tokens']:>20.1f}"
                         f"  {s['bytes_per_token']:>11.1f}  {s.get('tau', float('nan')):.2f}")
    for m in METHODS:
        for n, d in summary.get("disconnect", {}).get(m, {}).items():
            repeats = d.get("repeated_4grams")
            lines.append(f"disconnect {m} {n}: continuation perplexity {d['perplexity']:.2f} (target's own greedy: "
                         f"{d['target_greedy_perplexity']:.2f}), exact match {d['exact_match_tokens']:.1f} tokens"
                         + ("" if repeats is None else f", repeated 4-grams {repeats:.0%} (target's own greedy: "
                                                       f"{d['target_greedy_repeated_4grams']:.0%})"))
    return "\n".join(lines)
