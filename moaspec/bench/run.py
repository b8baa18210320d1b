"""Run decoding methods over SpecBench questions, interleaved per prompt, and summarise them.

Multi-turn questions are answered turn by turn in one conversation (each method
continues its own conversation). Every method is warmed up first; then, for each
question, the methods run back to back in an order that rotates from question to
question, so that machine noise hits all of them alike. Speedups are ratios to
vanilla decoding measured in the same run.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moaspec.bench.journal import Journal
from moaspec.bench.methods import Method
from moaspec.chat import encode_chat
from moaspec.decoding.generation import length_histogram
from moaspec.fileio import atomic_write_text
from moaspec.models.loading import LoadedModel
from moaspec.models.packed_linear import small_row_kernels
from moaspec.progress import progress_bar
from moaspec.specbench import Question


def answer_question(target: LoadedModel, method: Method, q: Question, max_new: int) -> list[dict[str, Any]]:
    messages: list[dict[str, str]] = []
    turns = []
    for t, text in enumerate(q.turns):
        messages.append({"role": "user", "content": text})
        ids = encode_chat(target.tokenizer, messages)
        budget = min(max_new, target.cfg.max_position_embeddings - len(ids))
        if budget < 1:
            break  # the conversation no longer fits the context window
        r = method(ids, budget)
        messages.append({"role": "assistant", "content": r.text})
        calls = r.target_calls
        # tokens the target calls after prefill produced; transformers reports no per-call
        # lengths, and its answer holds neither the first token (prefill's) nor a final EOS
        produced = sum(r.accepted_lengths) if r.accepted_lengths else max(0, r.new_tokens - 1 + (r.finish_reason == "eos"))
        turns.append({"turn": t, "new_tokens": r.new_tokens, "wall_s": r.total_s, "prefill_s": r.prefill_s,
                      "draft_s": r.draft_s, "target_calls": calls, "verified_tokens": produced, "accepted_lengths": r.accepted_lengths,
                      "token_ids": r.token_ids, "text": r.text})
    return turns


def summarise(rows: Sequence[dict[str, Any]], methods: Sequence[str], greedy: bool = True) -> dict[str, Any]:
    """Per method, per category and overall: speed, speedup vs vanilla, τ, calls, tokens, mismatches.

    ``greedy_mismatches`` counts answers that differ from vanilla's, a loss of
    losslessness for greedy decoding; sampled answers differ by chance while keeping the
    target's distribution (the tests check that), so for them it is ``None``.

    Where a decoding cycle's time goes: ``draft_ms_per_call`` is the drafter's share per
    target call (proposing, and taking in what was verified), ``verify_ms_per_call`` the
    rest after the prefill (the target's forward, verification, bookkeeping), as in
    ``moaspec generate --json``. Two drafters at one τ differ in speed by the first.
    """
    by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[(r["method"], r["category"])].append(r)
        by[(r["method"], "overall")].append(r)
    vanilla_ids = {(r["question_id"], r["category"]): [t["token_ids"] for t in r["turns"]]
                   for r in rows if r["method"] == "vanilla"}
    categories = sorted({r["category"] for r in rows}) + ["overall"]
    out: dict[str, Any] = {}
    for m in methods:
        out[m] = {}
        for c in categories:
            rs = by.get((m, c), [])
            turns = [t for r in rs for t in r["turns"]]
            new = sum(t["new_tokens"] for t in turns)
            wall = sum(t["wall_s"] for t in turns)
            calls = sum(t["target_calls"] for t in turns)
            verified = sum(t["verified_tokens"] for t in turns)
            draft = sum(t.get("draft_s", 0.0) for t in turns)  # answers of older runs lack the split
            decode = wall - sum(t.get("prefill_s", 0.0) for t in turns)
            mismatches = None
            if vanilla_ids and greedy:
                mismatches = sum(1 for r in rs if [t["token_ids"] for t in r["turns"]] != vanilla_ids.get((r["question_id"], r["category"])))
            out[m][c] = {"tokens_per_s": round(new / wall, 3) if wall else 0.0, "tau": round(verified / calls, 3) if calls else 0.0,
                         "target_calls": calls, "new_tokens": new, "wall_s": round(wall, 3),
                         "greedy_mismatches": mismatches, "prompts": len(rs),
                         "draft_ms_per_call": round(1000 * draft / calls, 2) if calls else 0.0,
                         "verify_ms_per_call": round(1000 * (decode - draft) / calls, 2) if calls else 0.0}
    if "vanilla" in methods:
        for m in methods:
            for c in categories:
                base = out["vanilla"][c]["tokens_per_s"]
                out[m][c]["speedup"] = round(out[m][c]["tokens_per_s"] / base, 3) if base else None
    return out


def accepted_histograms(rows: Sequence[dict[str, Any]]) -> dict[str, dict[int, int]]:
    lengths: dict[str, list[int]] = defaultdict(list)
    for r in rows:
        for t in r["turns"]:
            lengths[r["method"]] += t["accepted_lengths"]
    return {m: length_histogram(ls) for m, ls in lengths.items()}


def run_bench(target: LoadedModel, questions: Sequence[Question], methods: dict[str, Method], max_new: int,
              output: Path, progress: bool = True, settings: dict[str, Any] | None = None,
              greedy: bool = True) -> dict[str, Any]:
    """Answer every question with every method; resume from ``answers.partial.jsonl`` when one is there.

    ``settings`` are the options that shape the methods (drafters, chain, tree, sampling); a
    journal is resumed only by a run with the same methods, questions, budget and settings.
    ``greedy`` says whether the methods decode greedily (answers then must equal vanilla's).
    """
    from moaspec.chat import chat_messages

    names = list(methods)
    output.mkdir(parents=True, exist_ok=True)
    run = {"methods": names, "max_new_tokens": max_new, "settings": settings or {},
           "questions": [[q.category, str(q.question_id)] for q in questions]}
    journal = Journal(output / "answers.partial.jsonl", run, "moaspec bench", f"{len(questions)} questions")
    resumed = len(journal.done)  # its keys are question indices: the header pins the questions
    warm = encode_chat(target.tokenizer, chat_messages("Say hello."))
    for m in names:
        methods[m](warm, 16)
    rows: list[dict[str, Any]] = []
    bar = progress_bar(total=len(questions) * len(names), initial=resumed * len(names), unit="answer", desc="moaspec bench",
                       disable=not progress)
    for i, q in enumerate(questions):
        if str(i) in journal.done:
            rows.extend(journal.done[str(i)])
            continue
        answers = []
        for m in names[i % len(names):] + names[: i % len(names)]:
            answers.append({"method": m, "category": q.category, "question_id": q.question_id,
                            "turns": answer_question(target, methods[m], q, max_new)})
            bar.update(1)
        rows.extend(journal.record(str(i), answers))
    bar.close()
    kernels = small_row_kernels()  # what products of 1, 2, 3 rows ran on, as measured at load
    summary = {"methods": names, "max_new_tokens": max_new, "questions": len(questions), "resumed_questions": resumed,
               "greedy": greedy, "settings": settings or {}, "small_row_kernels": kernels and list(kernels.by_rows),
               "results": summarise(rows, names, greedy), "accepted_histogram": accepted_histograms(rows)}
    atomic_write_text(output / "answers.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    atomic_write_text(output / "summary.json", json.dumps(summary, indent=1))
    journal.finish()
    from moaspec.bench.plots import save_plots

    save_plots(summary, output)
    return summary


def table(summary: dict[str, Any]) -> str:
    res = summary["results"]
    cats = list(next(iter(res.values())))
    w = max(13, max(len(m) for m in res) + 1)
    lines = [f"{'method':<{w}}{'category':<12}{'tok/s':>8}{'speedup':>9}{'tau':>7}{'calls':>7}{'tokens':>8}{'mismatch':>9}"
             f"{'draft ms':>10}{'verify ms':>11}"]
    for m, per in res.items():
        for c in cats:
            r = per[c]
            sp = f"{r['speedup']:.2f}" if r.get("speedup") is not None else "-"
            mm = "-" if r["greedy_mismatches"] is None else str(r["greedy_mismatches"])
            lines.append(f"{m:<{w}}{c:<12}{r['tokens_per_s']:>8.1f}{sp:>9}{r['tau']:>7.2f}{r['target_calls']:>7}"
                         f"{r['new_tokens']:>8}{mm:>9}{r.get('draft_ms_per_call', 0.0):>10.1f}{r.get('verify_ms_per_call', 0.0):>11.1f}")
    return "\n".join(lines)
