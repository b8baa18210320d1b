"""Held-out chain-6 acceptance of a drafter: training's proxy (MoA) beside replayed real decoding (any drafter).

On the held-out slice of distillation data (the records ``moaspec train`` holds out
with the same ``--val-fraction``), per record:

* ``random segments`` — leading accepted drafts from the starts of random 5..15
  training segments (``val_tau_chain6`` of ``val_log.csv``);
* ``decode replay`` — greedy chain-6 decoding replayed along the target's greedy
  answers, cycle for cycle (``val_tau_decode``; exact, see
  ``tests/test_real_speculative.py`` and ``tests/test_speculative.py``), over whole
  answers and over their first ``--head`` tokens (as ``chain_tau.py`` decodes
  SpecBench). The only figure for EAGLE and independent drafters, which teacher
  forcing would feed true features or tokens inside random segments;
* ``top-1 by drafting step`` — how often step k of a cycle drafts the target's token
  when the steps before it were right: a drafter that reads the target's newest
  state well is best at step 1 (the first draft), where every cycle starts;
* MoA: first-draft top-1 when Cross-Attention may read only memory entries at least
  G tokens back (``--memory-gaps``): how much the drafter draws from the newest ones.

    .venv/bin/python benchmarks/held_out_tau.py --data ~/.cache/moaspec/data/gpu/data{1..8} [--drafter DIR]

Every figure uses inference's masks, whichever masks the drafter trained with (``moaspec train
--segment-start-in-memory`` included), so arms of an A/B comparison read alike. Per arm, top-1 by
drafting step 1..6 and the first draft with memory from G = 1 (decoding) and G = 8 tokens back,
on the same held-out records (pass the arms' --val-fraction and --max-len)::

    D=$(echo ~/.cache/moaspec/data/gpu/data{1..8})
    .venv/bin/python benchmarks/held_out_tau.py --data $D --threads 1 --memory-gaps 1,8 --drafter RUN_A/drafter
    .venv/bin/python benchmarks/held_out_tau.py --data $D --threads 1 --memory-gaps 1,8 --drafter RUN_B/drafter
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from moaspec.drafters import load_drafter, shipped_drafter
from moaspec.drafters.moa import MoADrafter
from moaspec.models import load_model
from moaspec.models.transformer import Transformer
from moaspec.training.dataset import Batch, collate, load_examples
from moaspec.training.distill import (
    Masks,
    acceptance_by_offset,
    accepted_runs,
    build_masks,
    drafter_loss,
    full_argmax,
    masks_from_starts,
    predicted_features,
    simulate_chain,
    step_accuracy,
    step_matches,
)
from moaspec.training.features import TargetOut, target_pass
from moaspec.training.masks import cycle_starts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", nargs="+", required=True, help="`moaspec data` directories")
    ap.add_argument("--drafter", default=None, help="drafter checkpoint directory (default: the shipped MoA)")
    ap.add_argument("--val-fraction", type=float, default=0.02)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--head", type=int, default=128, help="also replay only the first HEAD answer tokens")
    ap.add_argument("--memory-gaps", default="1,2,4,8,16,1024",
                    help="MoA: first-draft top-1 when Cross-Attention sees only memory entries at least G tokens back "
                         "(1 = as in decoding; a gap past the answer leaves the first token alone)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    lm = load_model(None, device="cpu")
    drafter = load_drafter(args.drafter or shipped_drafter(lm), lm, torch.float32)  # training's precision, as the replay
    moa = isinstance(drafter, MoADrafter)
    _, val = load_examples([Path(d) for d in args.data], lm.fingerprint, args.max_len, args.val_fraction)
    gen = torch.Generator().manual_seed(12345)
    seg = {"greedy": [0.0, 0.0], "sampled": [0.0, 0.0]}  # accepted drafts, segments
    replay = {"whole": [0, 0], "head": [0, 0]}  # tokens, verifications
    hits, cases = torch.zeros(6), torch.zeros(6)  # per drafting step, greedy answers
    gaps = [int(g) for g in args.memory_gaps.split(",")] if moa else []
    reach = torch.zeros(len(gaps), 2)  # first-draft hits, positions per gap
    for ex in val:
        batch = collate([ex])
        with torch.no_grad():
            tgt = target_pass(lm.model, batch.tokens, drafter.cfg.tli_layers if moa else 0)
            masks = build_masks(batch, gen, torch.zeros(1, dtype=torch.bool))
            greedy = full_argmax(lm.model, tgt.final[masks.loss])
            if moa:
                out = drafter_loss(drafter, lm.model, batch, masks, tgt)
                accepted, segments = acceptance_by_offset(out.draft_logits, greedy, drafter.to_target_ids, masks)
                seg["greedy" if ex.greedy else "sampled"][0] += float(accepted)
                seg["greedy" if ex.greedy else "sampled"][1] += float(segments)
            if ex.greedy:
                matches = step_matches(drafter, lm.model, batch, tgt, greedy)
                h, c = step_accuracy(matches, batch)
                hits, cases = hits + h, cases + c
                runs = accepted_runs(matches, batch)[0].tolist()
                for i, gap in enumerate(gaps):
                    reach[i] += first_draft_with_gap(drafter, lm.model, batch, tgt, greedy, gap)
                answer = len(ex.tokens) - ex.prompt_len
                for name, n in (("whole", answer), ("head", min(answer, args.head))):
                    added = simulate_chain(runs, ex.prompt_len, n)
                    replay[name][0] += sum(added)
                    replay[name][1] += len(added)
    greedy = sum(ex.greedy for ex in val)
    print(f"held-out records: {len(val)} ({greedy} greedy)")
    both = [seg["greedy"][0] + seg["sampled"][0], seg["greedy"][1] + seg["sampled"][1]]
    for name, (a, n) in [("random segments, all records", both), ("random segments, greedy records", seg["greedy"]),
                         ("random segments, sampled records", seg["sampled"])] if moa else []:
        print(f"{name:<42} tau {1 + a / max(n, 1):.3f}  ({int(n)} segments)")
    for name, (t, c) in [("decode replay, greedy answers, whole", replay["whole"]),
                         (f"decode replay, greedy answers, first {args.head}", replay["head"])]:
        print(f"{name:<42} tau {t / max(c, 1):.3f}  ({c} verifications)")
    print("top-1 by drafting step, greedy answers, true inputs: "
          + "  ".join(f"{k + 1}: {float(h / max(c, 1)):.3f}" for k, (h, c) in enumerate(zip(hits, cases))))
    if gaps:
        print("first-draft top-1 with memory entries only from G tokens back: "
              + "  ".join(f"G={g}: {float(h / max(n, 1)):.3f}" for g, (h, n) in zip(gaps, reach.tolist())))


def first_draft_with_gap(drafter: MoADrafter, target: Transformer, batch: Batch, tgt: TargetOut, greedy: torch.Tensor,
                         gap: int) -> torch.Tensor:
    """[hits, positions]: first drafts (every response position a cycle start) when Cross-Attention sees only memory
    entries at least ``gap`` positions before the query; the first token stays visible so that no row is empty.

    Gap 1 is decoding itself. How much the top-1 falls as the gap grows says how much the drafter draws from the
    target's newest states, the ones EAGLE's first draft reads.
    """
    S = batch.tokens.shape[1]
    starts = cycle_starts(int(batch.prompt_lens[0]), int(batch.lengths[0]), 1, 0)[None]
    masks = masks_from_starts(batch, starts, torch.zeros(1, dtype=torch.bool))
    pos = torch.arange(S)
    ca = masks.ca & (pos[:, None] - pos[None, :] >= gap)
    ca[:, :, 0] = True
    masks = Masks(masks.sa, ca, masks.starts, masks.loss)
    logits = drafter.head(predicted_features(drafter, target, batch, masks, tgt)[0][0])
    hit = drafter.to_target_ids(logits.argmax(-1)) == greedy
    return torch.tensor([float(hit.sum()), float(hit.numel())])


if __name__ == "__main__":
    main()
