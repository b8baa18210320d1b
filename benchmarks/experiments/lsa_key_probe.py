"""Linear probes of what Layer Self-Attention reads: the target's keys as cached (rotated) or derotated.

The target's cache holds every layer's keys after RoPE, turned by angles that grow with
the token's position, so most of a key's pairs reach LSA scrambled by where the token
stands. This measures, without training a drafter, how much a position-blind reader
loses to that: ridge regressions (closed form, standardised inputs, ``--lam`` times the
mean diagonal as the ridge) from a feature set of verified token ``p`` plus the
embedding of token ``p+1`` (what a first draft also has) to the target's final state at
``p+1``, the state MoA's first draft predicts. Scored on held-out sequences (every fifth
example) by R² and by how often the ``lm_head`` of the prediction has the target's own
top-1 token. Feature sets: the target's final state of ``p`` (EAGLE's input), the last
layer's K/V, every layer's K/V, each with keys as cached and derotated
(:meth:`moaspec.models.transformer.Transformer.unrotated_keys`, what a MoA drafter with
``derotate_keys`` reads), every layer's values alone, and every layer's K/V averaged over
the layers (what one shared projection followed by a mean over layers, LSA's frame
without its attention, can at best keep linearly). With ``--drafter``, also a
MoA drafter's own memory entries (what its Cross-Attention reads, made by its trained
LSA): if they predict less than the raw K/V they were made from, LSA loses on the way
what a first draft needs; if as much, the loss is in how Cross-Attention reads them.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/lsa_key_probe.py --data ~/.cache/moaspec/data/DIR --examples 200
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from moaspec.drafters.checkpoint import load_drafter
from moaspec.drafters.moa import MoADrafter
from moaspec.models import load_model
from moaspec.training.dataset import load_examples
from moaspec.training.features import target_pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", nargs="+", required=True, help="`moaspec data` directories (never SpecBench)")
    ap.add_argument("--examples", type=int, default=200, help="assistant turns to probe (every fifth held out)")
    ap.add_argument("--lam", default="0.001,0.1", help="ridge strengths, relative to the mean diagonal")
    ap.add_argument("--drafter", type=Path, help="a MoA drafter directory: also probe its memory entries")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    lm = load_model(None, device="cpu")
    target, cfg = lm.model, lm.cfg
    examples = load_examples([Path(d) for d in args.data], lm.fingerprint, 1024, 0.0)[0][: args.examples]
    kvd, L = cfg.kv_dim, cfg.num_layers
    sets: dict[str, list[torch.Tensor]] = {name: [] for name in (
        "final state (EAGLE's input)", "last layer K/V, keys as cached", "last layer K/V, keys derotated",
        f"all {L} layers' K/V, keys as cached", f"all {L} layers' K/V, keys derotated", f"all {L} layers' values",
        f"all {L} layers' K/V averaged over layers, keys as cached",
        f"all {L} layers' K/V averaged over layers, keys derotated")}
    drafter = None
    if args.drafter is not None:
        drafter = load_drafter(args.drafter, lm, torch.float32)
        if not isinstance(drafter, MoADrafter):
            raise SystemExit(f"{args.drafter} is not a MoA drafter")
        sets[f"the drafter's memory entries ({drafter.cfg.memory_source}, LSA width {drafter.cfg.lsa_width})"] = []
    names = list(sets)
    targets, next_embeddings, sequence = [], [], []
    for i, ex in enumerate(examples):
        tokens = torch.tensor(ex.tokens)[None]
        S = tokens.shape[1]
        with torch.no_grad():
            out = target_pass(target, tokens, 0)
            kv = out.token_kv[0]  # [S, L, 2 kv_dim]
            kv_de = target.unrotated_keys(out.token_kv, torch.arange(S))[0]
            p = torch.arange(ex.prompt_len, S - 1)  # verified token p; the first draft's input token p + 1
            kv_p, kv_de_p = kv[p], kv_de[p]  # [P, L, 2 kv_dim], gathered once for every feature set below
            feature_sets = [out.final[0, p], kv_p[:, -1], kv_de_p[:, -1], kv_p.flatten(1), kv_de_p.flatten(1),
                            kv_p[:, :, kvd:].flatten(1), kv_p.mean(1), kv_de_p.mean(1)]
            if drafter is not None:  # loaded in fp32, so its entries come out in fp32 like the rest
                feature_sets.append(drafter.memory(out.token_kv, out.final, torch.arange(S))[0, p])
            for name, feats in zip(names, feature_sets):
                sets[name].append(feats)
            targets.append(out.final[0, p + 1])
            next_embeddings.append(target.embed(tokens[0, p + 1]))
            sequence.append(torch.full((len(p),), i))
    y, emb, seq = torch.cat(targets).double(), torch.cat(next_embeddings).double(), torch.cat(sequence)
    test = seq % 5 == 0
    head = target.lm_head.weight.detach().double()
    true_top = (y[test] @ head.T).argmax(-1)
    print(f"{len(y)} response positions from {len(examples)} turns ({int(test.sum())} held out)")
    print("| features (+ the next token's embedding) | width | ridge | R² of the next final state | top-1 as the target |")
    print("| --- | ---: | ---: | ---: | ---: |")
    lams = [float(x) for x in args.lam.split(",")]
    for name, feats in [("next token's embedding alone", [torch.zeros(len(y), 0)])] + list(sets.items()):
        x = torch.cat(feats).double()
        for lam in lams:
            r2, top1 = ridge_probe(torch.cat([x, emb], dim=1), y, test, head, true_top, lam)
            print(f"| {name} | {x.shape[1]} | {lam:g} | {r2:.3f} | {top1:.3f} |", flush=True)


def ridge_probe(x: torch.Tensor, y: torch.Tensor, test: torch.Tensor, head: torch.Tensor, true_top: torch.Tensor,
                lam: float) -> tuple[float, float]:
    """Fit ``y ≈ x·B + c`` on the training rows, return (R², top-1 agreement of ``head``) on the test rows."""
    mu, sd = x[~test].mean(0), x[~test].std(0) + 1e-6
    xs = torch.cat([(x - mu) / sd, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    gram = xs[~test].T @ xs[~test]
    ridge = lam * gram.diagonal().mean() * torch.eye(len(gram), dtype=x.dtype)
    b = torch.linalg.solve(gram + ridge, xs[~test].T @ y[~test])
    pred = xs[test] @ b
    r2 = 1 - ((pred - y[test]) ** 2).sum() / ((y[test] - y[test].mean(0)) ** 2).sum()
    top1 = ((pred @ head.T).argmax(-1) == true_top).double().mean()
    return float(r2), float(top1)


if __name__ == "__main__":
    main()
