"""This project's decoding against llama.cpp on the same GGUF file, interleaved per prompt in one run.

llama.cpp is what a CPU user compares against (DESIGN-FACTS §6): it runs the default target's
Q4_1 file with 4-bit kernels that round activations to 8 bits. This runtime reads the same 4-bit
blocks in fp32 arithmetic (``moaspec/models/block_kernel.cpp``), or streams the dequantised fp32
weights (``--dense-weights``, the ``-fp32`` methods). Methods, each greedy, same prompts (the first
turn of the first K questions of every SpecBench file, in the target's chat template), same thread count:

- ``plain``: this runtime's plain decoding (the default: 4-bit blocks, fp32 arithmetic);
- ``plain-fp32``: the same on the dequantised fp32 weights;
- ``plain-avx2``: ``plain`` on the kernel's AVX2 loops, where the CPU has AVX-512 and ``plain`` runs its AVX-512 ones;
- ``moa-tree``: the shipped MoA drafter's tree alone (depth 2, top-2, 4 nodes; no prompt lookup);
- ``default``: the main job's decoding: prompt lookup and MoA chains, decided cycle by cycle by this host's
  measured costs (``moaspec.decoding.policy``);
- ``fixed``: the decoding that was the default before the cost-aware policy (lookup 10, else MoA chains of 2);
- ``moa-tree-cost``: ``moa-tree`` with a plain step wherever the tree is not expected to pay;
- ``default-fp32``: the same on the dequantised fp32 weights;
- ``default-torch-drafter``: the default with the drafter in fp32 torch (``--drafter-dtype float32``), not on
  8-bit blocks with compiled layers (the default on CPUs without bf16 kernels);
- ``default-candidate``: the default with the drafter ``--candidate DIR`` (e.g. a continued one; run when given);
- ``llama.cpp``: llama-cpp-python's plain decoding of the same GGUF file (its own kernels);
- ``llama.cpp-pld``: the same with llama-cpp-python's prompt-lookup drafter (10 tokens).

The two paths of this runtime differ only in the order of fp32 sums, so their greedy answers can
part only where two tokens nearly tie: for every answer of ``plain`` that parts from
``plain-fp32``'s the script prints the fp32 logit margin between the two tokens where they part.

Each prompt runs every method back to back, in an order rotated per prompt, after one warm-up
each, so machine noise hits all alike; tokens/s = new tokens / wall time (prefill included), the
figures that compare are the ratios. llama.cpp's greedy text is not this runtime's (4-bit products
in another order round otherwise), so the script reports how many tokens each answer shares with
``plain`` before they part, and, as a check, whether this runtime's methods equal ``plain`` exactly.

llama-cpp-python is not a dependency of the project (it compiles llama.cpp, ~15 minutes here):

    .venv/bin/pip install llama-cpp-python==0.3.36
    .venv/bin/python benchmarks/llama_cpp_peer.py --per-file 10 --max-new-tokens 256 --threads 2

``--model FILE.gguf`` runs both on another GGUF file of the default model (``quantise_default.py`` writes the
usual ones: Q4_K_M, ...), with the shipped drafter, which serves every quantisation of its target.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

import specbench_script  # beside this script
from moaspec.api import decoding_strategy
from moaspec.chat import chat_messages, encode_chat
from moaspec.decoding import GenerationConfig
from moaspec.decoding.opening import stop_token_ids
from moaspec.decoding.prefill import common_prefix
from moaspec.decoding.tree import TreeShape
from moaspec.models import block_kernel
from moaspec.models.gguf_blocks import dense_products
from moaspec.models.sources import default_gguf_path

Run = Callable[[list[int], int], tuple[list[int], float]]  # (prompt ids, max new tokens) -> (new ids, seconds)


def load_llama(threads: int, context: int, logits_all: bool = False, lookup: int = 0, model: str | None = None) -> Any:
    """llama-cpp-python's model of the GGUF file ``model`` (default: the default target's), with its prompt-lookup
    drafter of ``lookup`` tokens when > 0 (also used by ``llama_cpp_rows.py``), or an exit that says how to
    install it."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        raise SystemExit("llama-cpp-python is not installed: .venv/bin/pip install llama-cpp-python==0.3.36") from None
    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
    # with a draft model llama-cpp-python keeps every position's logits but sizes their buffer by logits_all
    # alone (0.3.36): without it a prompt longer than n_batch overflows the buffer
    return Llama(model_path=model or str(default_gguf_path()), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                 n_batch=512, logits_all=logits_all or draft is not None, draft_model=draft, verbose=False)


def llama_cpp_runner(threads: int, context: int, lookup: int, stops: set[int], model: str | None) -> Run:
    """Greedy decoding by llama-cpp-python on the GGUF file ``model`` (default: the default target's), ``lookup``
    > 0 with its prompt-lookup drafter, ending at the tokens this runtime stops at; each call starts from an
    empty cache (llama-cpp-python would otherwise reuse a shared prefix)."""
    llm = load_llama(threads, context, lookup=lookup, model=model)

    def run(prompt: list[int], max_new: int) -> tuple[list[int], float]:
        llm.reset()
        out: list[int] = []
        t0 = time.perf_counter()
        for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            if token in stops:
                break
            out.append(token)
            if len(out) == max_new:
                break
        return out, time.perf_counter() - t0

    return run


def moaspec_runner(lm: Any, strategy: Any, stops: set[int], dense: bool = False, isa: str | None = None) -> Run:
    """Greedy decoding by this runtime with ``strategy`` (plain when it has no drafter), on the dequantised fp32
    weights if ``dense``, on the kernel's ``isa`` loops if given (the process's own otherwise)."""

    def run(prompt: list[int], max_new: int) -> tuple[list[int], float]:
        own = block_kernel.instruction_set()
        if isa is not None:
            block_kernel.set_instruction_set(isa)
        try:
            with dense_products(lm.model) if dense else nullcontext():
                result = strategy.run(lm, prompt, GenerationConfig(max_new_tokens=max_new))
        finally:
            if isa is not None and own is not None:
                block_kernel.set_instruction_set(own)
        ids = [t for t in result.token_ids if t not in stops]
        return ids, result.total_s

    return run


def main() -> None:
    ap = specbench_script.parser(__doc__, per_file=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--lookup", type=int, default=10, help="llama.cpp-pld's drafted tokens per step")
    ap.add_argument("--methods", default="plain,plain-fp32,moa-tree,default,fixed,default-fp32,llama.cpp,llama.cpp-pld",
                    help="which of the methods above to run (plain always runs: the ratios "
                         "and the parting margins need them)")
    ap.add_argument("--plot", metavar="DIR", help="also draw speedup.png there: each method's tokens/s per category "
                                                  "over plain-fp32's (moaspec.bench.plots, as moaspec bench draws it)")
    ap.add_argument("--candidate", metavar="DIR", help="also run default-candidate: the default with this drafter "
                                                       "checkpoint beside --drafter's")
    ap.add_argument("--pause", type=float, default=0.0,
                    help="seconds to wait, untimed, before each method (threads still spinning from the last one)")
    args = ap.parse_args()
    lm, drafter = specbench_script.target_and_drafter_path(args)
    stops = stop_token_ids(lm.model, lm.tokenizer)
    prompts = [(q, encode_chat(lm.tokenizer, chat_messages(q.turns[0]))) for q in specbench_script.questions(args)]
    context = max(len(ids) for _, ids in prompts) + args.max_new_tokens + 16
    runners: dict[str, Callable[[], Run]] = {
        "plain": lambda: moaspec_runner(lm, decoding_strategy(lm, None), stops),
        "plain-fp32": lambda: moaspec_runner(lm, decoding_strategy(lm, None), stops, dense=True),
        "plain-avx2": lambda: moaspec_runner(lm, decoding_strategy(lm, None), stops, isa="avx2"),
        "moa-tree": lambda: moaspec_runner(lm, decoding_strategy(lm, drafter, tree=TreeShape(), lookup=0), stops),
        "moa-tree-cost": lambda: moaspec_runner(
            lm, decoding_strategy(lm, drafter, tree=TreeShape(), lookup=0, by_cost=True), stops),
        "default": lambda: moaspec_runner(lm, decoding_strategy(lm, drafter), stops),
        "fixed": lambda: moaspec_runner(lm, decoding_strategy(lm, drafter, by_cost=False), stops),
        "default-fp32": lambda: moaspec_runner(lm, decoding_strategy(lm, drafter), stops, dense=True),
        "default-torch-drafter": lambda: moaspec_runner(
            lm, decoding_strategy(lm, drafter, drafter_dtype="float32"), stops),
        "default-candidate": lambda: moaspec_runner(lm, decoding_strategy(lm, args.candidate), stops),
        "llama.cpp": lambda: llama_cpp_runner(args.threads, context, 0, stops, args.model),
        "llama.cpp-pld": lambda: llama_cpp_runner(args.threads, context, args.lookup, stops, args.model),
    }
    wanted = {m.strip() for m in args.methods.split(",")} | {"plain"}
    if args.candidate:
        wanted.add("default-candidate")
    elif "default-candidate" in wanted:
        raise SystemExit("--methods default-candidate needs --candidate DIR")
    unknown = wanted - set(runners)
    if unknown:
        raise SystemExit(f"--methods: unknown {', '.join(sorted(unknown))} (known: {', '.join(runners)})")
    methods = {name: make() for name, make in runners.items() if name in wanted}
    for run in methods.values():  # warm-up
        run(prompts[0][1], 16)
    names = list(methods)
    tokens: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # method -> category -> new tokens
    seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    agree: dict[str, list[int]] = defaultdict(list)  # tokens each answer shares with plain's before they part
    identical: dict[str, int] = defaultdict(int)
    answers_of: dict[str, list[list[int]]] = defaultdict(list)
    rows = []
    for i, (q, ids) in enumerate(prompts):
        answers, rates = {}, {}
        for name in names[i % len(names):] + names[: i % len(names)]:
            time.sleep(args.pause)
            out, dt = methods[name](ids, args.max_new_tokens)
            answers[name], rates[name] = out, len(out) / dt
            for key in (q.category, "overall"):
                tokens[name][key] += len(out)
                seconds[name][key] += dt
            rows.append({"question": f"{q.category}/{q.question_id}", "method": name, "new_tokens": len(out),
                         "wall_s": round(dt, 4)})
        for name, out in answers.items():
            answers_of[name].append(out)
            agree[name].append(common_prefix(out, answers["plain"]))
            identical[name] += out == answers["plain"]
        print(f"{q.category}/{q.question_id}: " + ", ".join(f"{n} {rates[n]:.1f}" for n in names) + " tok/s", flush=True)
    margins = (parting_margins(lm, prompts, answers_of["plain"], answers_of["plain-fp32"]) if "plain-fp32" in methods
               else [])
    for question, at, margin in margins:
        print(f"{question}: plain parts from plain-fp32 at new token {at}, where their fp32 logits differ by {margin:.2e}")
    categories = sorted({q.category for q, _ in prompts}) + ["overall"]
    rate = {n: {c: tokens[n][c] / seconds[n][c] for c in categories} for n in names}
    print(f"\n{'method':<15}" + "".join(f"{c:>10}" for c in categories) + f"{'vs plain':>10}{'vs llama.cpp':>14}"
          f"{'same as plain':>15}{'median shared':>15}")
    for n in names:
        print(f"{n:<15}" + "".join(f"{rate[n][c]:>10.1f}" for c in categories)
              + f"{rate[n]['overall'] / rate['plain']['overall']:>10.2f}"
              + (f"{rate[n]['overall'] / rate['llama.cpp']['overall']:>14.2f}" if "llama.cpp" in rate else f"{'-':>14}")
              + f"{identical[n]:>9} / {len(prompts):<3}{statistics.median(agree[n]):>15.0f}")
    if args.plot and "plain-fp32" in rate:
        from pathlib import Path

        from moaspec.bench.plots import save_plots

        speedups = {n: {c: {"speedup": rate[n][c] / rate["plain-fp32"][c]} for c in categories}
                    for n in names if n != "plain-fp32"}
        Path(args.plot).mkdir(parents=True, exist_ok=True)
        save_plots({"results": speedups}, Path(args.plot), baseline="plain decoding on fp32 weights")
    specbench_script.write_results(
        args, tokens_per_s=rate, same_as_plain=dict(identical), shared_with_plain=dict(agree), runs=rows,
        parting_margins=[{"question": q, "new_token": at, "fp32_logit_margin": m} for q, at, m in margins])


def parting_margins(lm: Any, prompts: list[tuple[Any, list[int]]], blocks: list[list[int]],
                    dense: list[list[int]]) -> list[tuple[str, int, float]]:
    """Where an answer on the 4-bit blocks parts from the fp32 path's: (question, new token index, the fp32
    logit margin between the two paths' tokens there), from one fp32 forward over the shared prefix."""
    out = []
    for (q, ids), a, b in zip(prompts, blocks, dense):
        at = common_prefix(a, b)
        if at == min(len(a), len(b)):
            continue
        seq = torch.tensor([ids + a[:at]])
        with torch.inference_mode(), dense_products(lm.model):
            logits = lm.model(seq, lm.model.new_cache(seq.shape[1]), logits_at=slice(-1, None)).logits[0, -1]
        out.append((f"{q.category}/{q.question_id}", at, float(logits[b[at]] - logits[a[at]])))
    return out


if __name__ == "__main__":
    main()
