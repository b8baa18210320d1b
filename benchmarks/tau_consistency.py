"""Does a MoA drafter accept at inference what training measured? Real chain drafting vs its teacher-forced replay.

For each SpecBench prompt, greedy chain drafting runs on the real model and records
how many drafts each verification accepted. The same output is then replayed
through the training path (``moaspec.training.distill``): one parallel pass with the
T-step-bounded masks whose segments are exactly the real verification cycles. If
the inference path (drafter state, memory updates, rollback) matches training, the
replay accepts the same number of drafts in every cycle, up to rounding near ties;
a lower ``val_tau_chain6`` than expected could then only come from the data, not
from a mismatch between how the drafter is trained and how it runs.

    .venv/bin/python benchmarks/tau_consistency.py --per-file 2 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from moaspec.chat import chat_messages, encode_chat
from moaspec.decoding import GenerationConfig
from moaspec.decoding.speculative import generate_chain
from moaspec.drafters import load_drafter, shipped_drafter
from moaspec.drafters.moa import MoADrafter
from moaspec.drafters.proposers import proposer_for
from moaspec.models import load_model
from moaspec.specbench import load_questions
from moaspec.training.dataset import Batch, Example, collate
from moaspec.training.distill import Masks, drafter_loss, full_argmax, masks_from_starts
from moaspec.training.features import target_pass

REPO = Path(__file__).resolve().parent.parent


def replay_masks(prompt_len: int, cycles: list[int], seq_len: int) -> Masks:
    """Training masks whose segments are the real verification cycles (``cycles``: tokens added by each)."""
    starts = torch.zeros(seq_len, dtype=torch.long)
    s = prompt_len
    for n in cycles:
        starts[s : s + n] = s
        s += n
    masks = masks_from_starts(Batch(torch.zeros(1, seq_len, dtype=torch.long), torch.tensor([seq_len]), torch.tensor([prompt_len])),
                              starts[None], torch.zeros(1, dtype=torch.bool))
    masks.loss[0, s:] = False  # not past the last cycle
    return masks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", default=str(REPO.parent / "shared" / "specbench"))
    ap.add_argument("--per-file", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--drafter", default=None, help="MoA checkpoint directory (default: the shipped one)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    lm = load_model(None, device="cpu")
    drafter = load_drafter(args.drafter or shipped_drafter(lm), lm, torch.float32)  # training's precision, as the replay
    if not isinstance(drafter, MoADrafter) or drafter.cfg.tli_layers:
        raise SystemExit("tau_consistency replays MoA drafters without Target Layer Inference")
    same = cycles_total = 0
    real_acc = replay_acc = 0.0
    for q in load_questions(args.questions, per_file=args.per_file):
        ids = encode_chat(lm.tokenizer, chat_messages(q.turns[0]))
        res = generate_chain(lm.model, lm.tokenizer, proposer_for(drafter), ids, GenerationConfig(max_new_tokens=args.max_new_tokens),
                             draft_len=6)
        cycles = res.accepted_lengths[:-1]  # the last cycle may be cut by the token budget or the end of the answer
        seq = ids + res.token_ids[: sum(cycles) + 1]
        batch = collate([Example(tuple(seq), len(ids))])
        masks = replay_masks(len(ids), cycles, len(seq))
        with torch.no_grad():
            tgt = target_pass(lm.model, batch.tokens, 0)
            out = drafter_loss(drafter, lm.model, batch, masks, tgt)
            greedy = full_argmax(lm.model, tgt.final[masks.loss])
        match = (drafter.to_target_ids(out.draft_logits.argmax(-1)) == greedy).long()
        replayed, offset = [], 0
        for n in cycles:  # per cycle: leading matches among its first six positions
            replayed.append(int(match[offset : offset + min(n, 6)].cumprod(0).sum()))
            offset += n
        real = [n - 1 for n in cycles]
        agree = sum(a == b for a, b in zip(real, replayed))
        same += agree
        cycles_total += len(cycles)
        real_acc += sum(real)
        replay_acc += sum(replayed)
        k = max(len(cycles), 1)
        print(f"{q.category:<11}{q.question_id:>6}  cycles {len(cycles):4d}  real tau {1 + sum(real) / k:5.2f}  "
              f"replayed tau {1 + sum(replayed) / k:5.2f}  same cycles {agree}", flush=True)
    print(f"\noverall: real chain-6 tau {1 + real_acc / cycles_total:.3f}, teacher-forced replay {1 + replay_acc / cycles_total:.3f}; "
          f"{same}/{cycles_total} cycles accept the same number of drafts")


if __name__ == "__main__":
    main()
