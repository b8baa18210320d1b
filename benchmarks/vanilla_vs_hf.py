"""Vanilla decoding: this runtime against transformers ``generate``, interleaved in one run.

Same weights (fp32), same prompts (the first turn of the first K questions of every
SpecBench file), greedy, same thread count. Per prompt the two run back to back in
alternating order, so machine noise hits both alike; the figures are ratios.

    .venv/bin/python benchmarks/vanilla_vs_hf.py --questions ../shared/specbench --per-file 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from moaspec.chat import chat_messages, encode_chat
from moaspec.decoding import GenerationConfig, generate
from moaspec.decoding.opening import stop_token_ids
from moaspec.models import load_model
from moaspec.specbench import load_questions

REPO = Path(__file__).resolve().parent.parent


def hf_generate(hf, prompt: list[int], max_new: int, eos: set[int]) -> tuple[list[int], float]:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)[0, len(prompt):].tolist()
    dt = time.perf_counter() - t0
    for i, t in enumerate(out):
        if t in eos:
            return out[:i], dt
    return out, dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", default=str(REPO.parent / "shared" / "specbench"))
    ap.add_argument("--per-file", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--output", default=None, help="write per-prompt results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    lm = load_model(args.model, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(lm.path), dtype=torch.float32).eval()
    eos = stop_token_ids(lm.model, lm.tokenizer)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    questions = load_questions(args.questions, per_file=args.per_file)
    prompts = [(q, encode_chat(lm.tokenizer, chat_messages(q.turns[0]))) for q in questions]

    warm = prompts[0][1]
    generate(lm.model, lm.tokenizer, warm, GenerationConfig(max_new_tokens=16))
    hf_generate(hf, warm, 16, eos)

    rows = []
    print(f"{'prompt':<22}{'ours tok/s':>11}{'hf tok/s':>10}{'ratio':>7}  same")
    for i, (q, ids) in enumerate(prompts):
        runs = {}
        for which in (("ours", "hf") if i % 2 == 0 else ("hf", "ours")):
            if which == "ours":
                r = generate(lm.model, lm.tokenizer, ids, config)
                runs["ours"] = (r.token_ids, r.total_s)
            else:
                runs["hf"] = hf_generate(hf, ids, args.max_new_tokens, eos)
        (ot, os_), (ht, hs) = runs["ours"], runs["hf"]
        row = {"question": f"{q.category}/{q.question_id}", "ours_tokens": len(ot), "ours_s": os_,
               "hf_tokens": len(ht), "hf_s": hs, "identical": ot == ht}
        rows.append(row)
        o_tps, h_tps = len(ot) / os_, len(ht) / hs
        print(f"{row['question']:<22}{o_tps:>11.1f}{h_tps:>10.1f}{o_tps / h_tps:>7.2f}  {'yes' if row['identical'] else 'NO'}")
    o_all = sum(r["ours_tokens"] for r in rows) / sum(r["ours_s"] for r in rows)
    h_all = sum(r["hf_tokens"] for r in rows) / sum(r["hf_s"] for r in rows)
    same = sum(r["identical"] for r in rows)
    print(f"{'overall':<22}{o_all:>11.1f}{h_all:>10.1f}{o_all / h_all:>7.2f}  {same}/{len(rows)} identical")
    if args.output:
        Path(args.output).write_text(json.dumps({"rows": rows, "ours_tokens_per_s": o_all, "hf_tokens_per_s": h_all,
                                                 "ratio": o_all / h_all, "identical": same, "prompts": len(rows)}, indent=2))


if __name__ == "__main__":
    main()
