"""Chain acceptance length τ of a drafter (any kind) on SpecBench, per category, with vanilla decoding interleaved.

Greedy, first turns, chains of ``--draft-len`` drafts. For every prompt the chain
run and a vanilla run go back to back (alternating order), so tokens/s are compared
under the same machine noise, and every chain output is checked token for token
against vanilla's (losslessness on the real model).

    .venv/bin/python benchmarks/chain_tau.py --questions ../shared/specbench --per-file 10 --max-new-tokens 128

``--calibration`` adds how often the target accepted a draft, by the drafter's own
probability of it: the evidence behind ``--draft-confidence``.

``--vocabulary`` asks what the reduced draft vocabulary costs: ``prompt`` adds every
prompt token it lacks to the drafter's head for that prompt, ``full`` drafts over the
target's whole vocabulary (both slower; for measuring, not for use). Every run prints
the share of the answer's tokens that the trained draft vocabulary lacks.
"""

from __future__ import annotations

from collections import defaultdict

import torch

import specbench_script  # beside this script
from moaspec.chat import chat_messages, encode_chat
from moaspec.decoding import GenerationConfig, generate
from moaspec.decoding.speculative import generate_chain
from moaspec.drafters import load_drafter
from moaspec.drafters.base import Drafter
from moaspec.drafters.proposers import DrafterProposer, proposer_for
from moaspec.models.transformer import Transformer

BUCKETS = 10  # draft probabilities in tenths


def recording_probabilities(proposer: DrafterProposer, log: list[list[float]]) -> DrafterProposer:
    """``proposer``, appending for each chain it drafts the drafter's probability of each greedy draft."""
    feed, propose = proposer._feed, proposer.propose

    def recorded_feed(*args, **kwargs):  # type: ignore[no-untyped-def]
        logits, features = feed(*args, **kwargs)
        log[-1].append(float(logits[-1].float().softmax(-1).max()))
        return logits, features

    def recorded_propose(tokens, n, sampling, generator):  # type: ignore[no-untyped-def]
        log.append([])
        drafts = propose(tokens, n, sampling, generator)
        log[-1] = log[-1][: len(drafts.tokens)]  # the feed after the last draft, if any, proposed nothing
        return drafts

    proposer._feed, proposer.propose = recorded_feed, recorded_propose  # type: ignore[method-assign]
    return proposer


def calibration(chains: list[list[float]], accepted: list[int]) -> list[dict[str, float]]:
    """How often the target accepted a draft, by the drafter's probability of it (drafts whose
    predecessors in the chain were all accepted; ``accepted``: tokens per verification, drafts + 1)."""
    seen, kept = [0] * BUCKETS, [0] * BUCKETS
    for probs, a in zip(chains, accepted, strict=True):
        for k, p in enumerate(probs[:a]):  # up to and including the first rejected draft
            b = min(BUCKETS - 1, int(p * BUCKETS))
            seen[b] += 1
            kept[b] += k < a - 1
    return [{"probability": f"{b / BUCKETS:.1f}-{(b + 1) / BUCKETS:.1f}", "drafts": seen[b],
             "accepted": round(kept[b] / seen[b], 3) if seen[b] else None} for b in range(BUCKETS)]


def use_vocabulary(drafter: Drafter, target: Transformer, ids: torch.Tensor) -> None:
    """Draft over the target's tokens ``ids`` (measurement only: the drafter was trained on its own vocabulary)."""
    drafter.draft_vocab = ids
    drafter.attach(target)


def main() -> None:
    ap = specbench_script.parser(__doc__, per_file=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-len", type=int, default=6)
    ap.add_argument("--no-vanilla", action="store_true",
                    help="τ only: skip the interleaved vanilla runs (no speedup, no losslessness check), half the time")
    ap.add_argument("--calibration", action="store_true",
                    help="also print how often drafts were accepted by the drafter's probability of them")
    ap.add_argument("--vocabulary", choices=("draft", "prompt", "full"), default="draft",
                    help="the trained draft vocabulary, plus each prompt's tokens, or the whole vocabulary")
    args = ap.parse_args()
    lm, path = specbench_script.target_and_drafter_path(args)
    drafter = load_drafter(path, lm)
    trained = drafter.draft_vocab.clone() if drafter.draft_vocab is not None else torch.arange(lm.cfg.vocab_size)
    in_trained = torch.zeros(lm.cfg.vocab_size, dtype=torch.bool)
    in_trained[trained] = True
    if args.vocabulary == "full":
        use_vocabulary(drafter, lm.model, torch.arange(lm.cfg.vocab_size))
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    questions = specbench_script.questions(args)
    prompts = [(q, encode_chat(lm.tokenizer, chat_messages(q.turns[0]))) for q in questions]
    generate_chain(lm.model, lm.tokenizer, proposer_for(drafter), prompts[0][1], GenerationConfig(max_new_tokens=16))
    generate(lm.model, lm.tokenizer, prompts[0][1], GenerationConfig(max_new_tokens=16))

    rows = []
    chains: list[list[float]] = []  # per verification, the drafter's probability of each draft (--calibration)
    for i, (q, ids) in enumerate(prompts):
        out = {}
        order = ("spec",) if args.no_vanilla else ("spec", "vanilla") if i % 2 == 0 else ("vanilla", "spec")
        for which in order:
            if which == "spec":
                proposer = proposer_for(drafter)
                if args.calibration:
                    recording_probabilities(proposer, chains)
                if args.vocabulary == "prompt":
                    seen = torch.tensor(sorted(set(ids)))
                    use_vocabulary(drafter, lm.model, torch.cat([trained, seen[~in_trained[seen]]]))
                out["spec"] = generate_chain(lm.model, lm.tokenizer, proposer, ids, cfg, draft_len=args.draft_len)
            else:
                out["vanilla"] = generate(lm.model, lm.tokenizer, ids, cfg)
        m, v = out["spec"], out.get("vanilla", out["spec"])
        outside, in_prompt = [t for t in m.token_ids if not in_trained[t]], set(ids)
        rows.append({"category": q.category, "question": q.question_id, "tau": m.tau, "calls": m.target_calls,
                     "outside_vocab": len(outside), "outside_vocab_in_prompt": sum(t in in_prompt for t in outside),
                     "tokens": m.new_tokens, "spec_s": m.total_s, "vanilla_s": v.total_s, "draft_s": m.draft_s,
                     "identical": None if args.no_vanilla else m.token_ids == v.token_ids, "accepted": m.accepted_lengths})
        print(f"{q.category:<11}{q.question_id:>6}  tau {m.tau:5.2f}  drafted {m.tokens_per_s:6.1f} tok/s  "
              f"vanilla {v.tokens_per_s:6.1f}  {({True: 'same', False: 'MISMATCH', None: ''})[rows[-1]['identical']]}",
              flush=True)

    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[r["category"]].append(r)
    groups["overall"] = rows
    summary = {}
    print(f"\n{'category':<11}{'tau':>6}{'spec tok/s':>11}{'vanilla':>9}{'speedup':>9}{'mismatch':>10}{'outside vocab':>15}")
    for name, rs in groups.items():
        accepted = [a for r in rs for a in r["accepted"]]
        tau = sum(accepted) / len(accepted)
        spec = sum(r["tokens"] for r in rs) / sum(r["spec_s"] for r in rs)
        bad = sum(r["identical"] is False for r in rs)
        tokens = sum(r["tokens"] for r in rs)
        outside = sum(r["outside_vocab"] for r in rs)
        summary[name] = {"tau": round(tau, 3), "spec_tokens_per_s": round(spec, 2), "prompts": len(rs),
                         "outside_vocab": round(outside / tokens, 4),
                         "outside_vocab_in_prompt": round(sum(r["outside_vocab_in_prompt"] for r in rs) / max(outside, 1), 3)}
        if args.no_vanilla:
            print(f"{name:<11}{tau:>6.2f}{spec:>11.1f}{'-':>9}{'-':>9}{'-':>10}{outside / tokens:>15.1%}")
            continue
        van = sum(r["tokens"] for r in rs) / sum(r["vanilla_s"] for r in rs)
        summary[name].update({"vanilla_tokens_per_s": round(van, 2), "speedup": round(spec / van, 3), "greedy_mismatches": bad})
        print(f"{name:<11}{tau:>6.2f}{spec:>11.1f}{van:>9.1f}{spec / van:>9.2f}{bad:>10}{outside / tokens:>15.1%}")
    table = calibration(chains, [a for r in rows for a in r["accepted"]]) if args.calibration else None
    if table:
        print(f"\n{'draft probability':<19}{'drafts':>8}{'accepted':>10}")
        for line in table:
            accepted = "-" if line["accepted"] is None else f"{line['accepted']:.2f}"
            print(f"{line['probability']:<19}{line['drafts']:>8}{accepted:>10}")
    specbench_script.write_results(args, summary=summary, rows=rows, calibration=table)


if __name__ == "__main__":
    main()
