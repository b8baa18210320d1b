"""``moaspec train``: distil a drafter (MoA, EAGLE or independent) from the target."""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import shlex
from typing import TYPE_CHECKING, Any, NoReturn

from moaspec.cli import options
from moaspec.errors import MoaspecError

if TYPE_CHECKING:
    from moaspec.training.trainer import TrainConfig

KINDS = ("moa", "eagle", "independent")


def _lsa_width(text: str) -> int | str:
    """``--lsa-width``: a whole number (checked against LSA's 64-wide heads later) or "full"."""
    if text == "full":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a whole number nor 'full'") from None


def _pseudo_epoch(text: str) -> float:
    """``--pseudo-epoch``: a whole number of updates (>= 1), or a fraction of --steps in (0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < 1 or (value >= 1 and value.is_integer())):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a whole number of updates >= 1 nor a fraction in (0, 1)")
    return value


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    t = sub.add_parser("train", help="distil a MoA drafter from the target (HF Accelerate; works under accelerate launch / torchrun)")
    t.add_argument("--data", required=True, nargs="+", metavar="DIR",
                   help="one or more directories made by `moaspec data`, trained on together")
    t.add_argument("--output", required=True,
                   help="run directory: state, logs, and the exported drafter in OUTPUT/drafter (resumes if it exists); "
                        "with --arm or --arms, one run directory per drafter, OUTPUT/NAME")
    arms = t.add_mutually_exclusive_group()
    arms.add_argument("--arm", action="append", default=None, metavar="NAME[=OPTIONS]",
                      help="train this drafter beside the others given, on the same batches, the target's features "
                           "computed once for all (repeat the option, one per drafter; a single one trains in "
                           "OUTPUT/NAME alone); OPTIONS are the per-drafter "
                           "options below, quoted, on top of those given outside --arm (e.g. --arm "
                           "moa-cont='--kind moa --init-from DIR --lr 4e-4'); a NAME alone is a --kind; "
                           "each drafter trains in OUTPUT/NAME with its own optimizer, schedule, random stream and "
                           "checkpoints")
    arms.add_argument("--arms", type=_arm_kinds, default=None, metavar="KIND,KIND,...",
                      help="shorthand for --arm KIND for each kind listed (e.g. moa,eagle)")
    t.add_argument("--tokens-per-batch", type=int, default=4096, help="tokens per micro-batch and process, padding included")
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per update")
    t.add_argument("--max-len", type=int, default=1024, help="truncate sequences to this many tokens")
    t.add_argument("--tli-layers", type=int, default=0, help="Target Layer Inference: reuse the target's last N layers")
    t.add_argument("--val-fraction", type=float, default=0.02)
    t.add_argument("--mixed-precision", choices=("auto", "no", "fp16", "bf16"), default="auto",
                   help="autocast precision, fp32 master weights (auto: bf16 on GPUs and on CPUs with bf16 kernels, "
                        "fp16 on GPUs without bf16, else fp32)")
    t.add_argument("--seed", type=int, default=0,
                   help="decides the batches, and each drafter's first weights, segment draws and noise")
    t.add_argument("--same-data-as", default="", metavar="RUN",
                   help="train on exactly the batches another run used (its shards per epoch and draft vocabulary): "
                        "a like-for-like comparison even after the data set grew")
    t.add_argument("--no-feature-cache", action="store_true",
                   help="recompute the target's features every epoch instead of caching them (fp16, ~24 KiB/token for SmolLM2) under DIR/features")
    t.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop after the update under way once this many seconds of training have passed, every "
                        "drafter saved and exported (rerun the command to resume): for a fixed slot of machine time")
    t.add_argument("--no-progress", action="store_true")
    add_drafter_options(t)
    options.add_model_options(t)


def add_drafter_options(t: argparse.ArgumentParser) -> None:
    """The options that may differ between drafters trained together (also read inside ``--arm NAME=OPTIONS``)."""
    t.add_argument("--kind", choices=KINDS, default="moa",
                   help="drafter to train: MoA, the EAGLE baseline, or an independent small model (classic speculative decoding)")
    t.add_argument("--steps", type=int, default=1000, help="optimizer updates")
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--warmup", type=int, default=50, help="linear warm-up updates, then cosine decay (with --pseudo-epoch: then the authors' fall to a base)")
    t.add_argument("--draft-vocab", type=int, default=8192, help="draft logits over the K most frequent target outputs (0 = whole vocabulary)")
    t.add_argument("--segment-min", type=int, default=5, help="shortest T-step-bounded training segment")
    t.add_argument("--segment-max", type=int, default=15, help="longest T-step-bounded training segment")
    t.add_argument("--segment-long-fraction", type=float, default=0.0,
                   help="share of segments drawn longer, from segment-max+1 to --segment-long-max (drafting alone)")
    t.add_argument("--segment-long-max", type=int, default=0, help="longest of those long segments")
    t.add_argument("--no-staircase", action="store_true", help="no SA curriculum")
    recipe = t.add_argument_group(
        "the MoA authors' training recipe (huawei-noah/HEBO, branch mixture-of-attentions), each off by default")
    recipe.add_argument("--segment-start-in-memory", action="store_true",
                        help="MoA: Cross-Attention's training mask as the authors' (memory up to and including the "
                             "segment start, not strictly before it): the start reads its own entry (distance 0, "
                             "trained too) and the positions after it draft as inference's first and later drafts do, "
                             "so a segment of n positions trains n - 1 real drafts; Cross-Attention's reach becomes "
                             "--segment-max - 1. Decoding and the held-out evaluation are unchanged")
    recipe.add_argument("--segment-periodic", action="store_true",
                        help="MoA: one segment length per sequence, uniform in --segment-min..--segment-max, with a "
                             "segment starting at every response position that is a multiple of it (the authors' "
                             "`i %% every == 0`; their torch.randint(6, 15) is --segment-min 6 --segment-max 14), "
                             "instead of a fresh length for every segment")
    recipe.add_argument("--pseudo-epoch", type=_pseudo_epoch, default=None, metavar="UPDATES|FRACTION",
                        help="the authors' curriculum and learning rate, compressed: training is cut into pseudo-epochs "
                             "of UPDATES updates (or FRACTION of --steps; the authors' first of 40 epochs is 0.025); SA "
                             "is local with probability max(0, 1 - e/20) in pseudo-epoch e = 0, 1, ... "
                             "(all of the first one: context must come through Cross-Attention), and the learning "
                             "rate warms up to --lr, the peak, over --warmup updates, falls linearly to the base, "
                             "--lr/20, by the end of the first pseudo-epoch and stays there "
                             "(the authors: 6e-4 falling to 3e-5 over their first epoch). Default: the staircase "
                             "falls linearly to 0 at half of training, and the learning rate is warm-up and cosine")
    recipe.add_argument("--norm-init-std", type=float, default=0.0, metavar="STD",
                        help="MoA from random weights: draw the gains of SA's, CA's and LSA's norms and of the memory "
                             "norm from N(0, STD^2) (the authors: 0.02) instead of 1, so that those layers start "
                             "close to the identity (default 0: gains of 1)")
    recipe.add_argument("--embedding-noise", type=float, default=0.0, metavar="A",
                        help="EAGLE: add U(-A, A) noise to the token embeddings it reads in training, as the authors' "
                             "EAGLE does (A = 0.1 there), besides the U(-0.1, 0.1) on its input features; the "
                             "targets stay clean (default 0: features only)")
    t.add_argument("--kl-weight", type=float, default=None,
                   help="weight of the KL term of the loss (default 0.1, the paper's)")
    t.add_argument("--feature-weight", type=float, default=None,
                   help="weight of the SmoothL1 feature term (default 1.0, the paper's)")
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--save-every", type=int, default=50)
    t.add_argument("--sa-mlp", type=int, default=None, help="SA MLP width (default: the target's)")
    t.add_argument("--ca-mlp", type=int, default=None, help="CA MLP width (default: the target's)")
    t.add_argument("--lsa-width", type=_lsa_width, default=None,
                   help="LSA width, a multiple of 64, or 'full': a layer's K/V width, the paper's "
                        "(default: half of that)")
    t.add_argument("--lsa-mlp", type=int, default=None, help="LSA MLP width (default: twice the LSA width)")
    memory = t.add_mutually_exclusive_group()
    memory.add_argument("--no-lsa", action="store_true",
                        help="ablation: MoA's memory from the target's final states instead of Layer Self-Attention over all layers")
    memory.add_argument("--memory-final", action="store_true",
                        help="extension beyond the paper: each memory entry adds a projection of the target's final state "
                             "of its token to LSA's output (with --init-from a plain MoA drafter: added at zero)")
    t.add_argument("--newest-entry", action="store_true",
                   help="extension beyond the paper: Cross-Attention's input also carries a projection of the newest "
                        "memory entry it may read, as EAGLE's first draft reads the newest verified state "
                        "(with --init-from a drafter without it: added at zero)")
    t.add_argument("--derotate-keys", action="store_true",
                   help="extension beyond the paper: Layer Self-Attention reads each layer's keys with their rotary "
                        "position removed (the cache holds them rotated); with --init-from a drafter without it: "
                        "an approximate warm start")
    t.add_argument("--layers", type=int, default=None,
                   help="independent drafter: decoder blocks, copied from the target's first ones (default 2)")
    t.add_argument("--init-from", default="",
                   help="start from this exported drafter (RUN/drafter) instead of random weights; "
                        "a MoA one may change --tli-layers or add --memory-final, --newest-entry or --derotate-keys")
    t.add_argument("--compile", action="store_true",
                   help="run the drafter's training pass through torch.compile: about 30 s to compile, then an MoA "
                        "update in two thirds of the time on a CPU (falls back to eager with a warning if compiling fails)")
    t.add_argument("--log-every", type=int, default=1,
                   help="a train_log.csv row every this many updates (and at saves): the losses are read back from "
                        "the device only then, so that a GPU never waits for the host between updates")


class _ArmParser(argparse.ArgumentParser):
    """Parses one ``--arm NAME=OPTIONS``; a bad option is a MoaspecError naming the drafter, not an exit."""

    def error(self, message: str) -> NoReturn:
        raise MoaspecError(f"{self.prog}: {message}")


def _arm_kinds(text: str) -> list[str]:
    """``--arms``: a comma list of distinct drafter kinds."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    if not kinds or len(set(kinds)) != len(kinds) or any(k not in KINDS for k in kinds):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of distinct kinds among {', '.join(KINDS)}")
    return kinds


def drafter_settings(args: argparse.Namespace) -> list[tuple[str, argparse.Namespace]]:
    """Each drafter to train with its options: ``[("", args)]`` for one, else (NAME, the options given outside
    ``--arm`` with the arm's own on top) for each ``--arm``/``--arms``."""
    specs = [f"{k}=--kind {k}" for k in args.arms] if args.arms else args.arm
    if not specs:
        return [("", args)]
    arms: list[tuple[str, argparse.Namespace]] = []
    for spec in specs:
        name, _, text = spec.partition("=")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise MoaspecError(f"--arm {spec!r}: a drafter's name (its directory under --output) is letters, digits, "
                               "'.', '_' and '-'")
        if any(name == other for other, _ in arms):
            raise MoaspecError(f"--arm {name} is given twice")
        if not text and name not in KINDS:
            raise MoaspecError(f"--arm {name}: a name alone must be a kind ({', '.join(KINDS)}); "
                               f"give its options as {name}='--kind ...'")
        parser = _ArmParser(prog=f"--arm {name}", add_help=False)
        add_drafter_options(parser)
        try:
            words = shlex.split(text or f"--kind {name}")
        except ValueError as exc:
            raise MoaspecError(f"--arm {name}: its options cannot be read ({exc})") from None
        arms.append((name, parser.parse_args(words, namespace=copy.copy(args))))
    return arms


def train_config(args: argparse.Namespace) -> TrainConfig:
    """One drafter's TrainConfig from its options, checked before the target loads."""
    from moaspec.training.trainer import TrainConfig, check_recipe_options

    options.require(args, ">= 1", options.at_least(1), "steps", "tokens_per_batch", "grad_accum", "max_len",
                    "eval_every", "save_every", "log_every", "segment_min")
    options.require(args, "a finite number > 0", options.finite_positive, "lr")
    options.require(args, ">= 0", options.at_least(0), "warmup", "draft_vocab")
    options.require(args, "in (0, 1)", lambda v: 0 < v < 1, "val_fraction")
    if args.segment_max < args.segment_min:
        raise MoaspecError("--segment-max must be >= --segment-min")
    options.require(args, "a finite number >= 0", lambda v: math.isfinite(v) and v >= 0, "kl_weight", "feature_weight")
    weights = {k: v for k in ("kl_weight", "feature_weight") if (v := getattr(args, k)) is not None}
    if not 0 <= args.segment_long_fraction < 1 or (args.segment_long_fraction > 0 and args.segment_long_max <= args.segment_max):
        raise MoaspecError("--segment-long-fraction must be in [0, 1), and with it --segment-long-max > --segment-max")
    if args.no_lsa and args.memory_final:  # exclusive on one command line; an --arm's options could combine them
        raise MoaspecError("--no-lsa and --memory-final exclude each other: --no-lsa removes the memory's LSA part")
    pseudo_epoch = 0
    if args.pseudo_epoch is not None:
        pseudo_epoch = int(args.pseudo_epoch) if args.pseudo_epoch >= 1 else max(1, round(args.pseudo_epoch * args.steps))
    cfg = TrainConfig(
        kind=args.kind, steps=args.steps, tokens_per_batch=args.tokens_per_batch, grad_accum=args.grad_accum, lr=args.lr,
        warmup=args.warmup, max_len=args.max_len, segment_min=args.segment_min, segment_max=args.segment_max,
        segment_long_max=args.segment_long_max, segment_long_fraction=args.segment_long_fraction,
        staircase=not args.no_staircase, val_fraction=args.val_fraction, eval_every=args.eval_every,
        save_every=args.save_every, draft_vocab=args.draft_vocab, tli_layers=args.tli_layers, seed=args.seed,
        mixed_precision=args.mixed_precision, cache_features=not args.no_feature_cache, init_from=args.init_from,
        same_data_as=args.same_data_as, segment_start_in_memory=args.segment_start_in_memory,
        segment_periodic=args.segment_periodic, pseudo_epoch=pseudo_epoch, norm_init_std=args.norm_init_std,
        embedding_noise=args.embedding_noise, log_every=args.log_every, **weights,
    )
    check_recipe_options(cfg)
    if cfg.kl_weight == cfg.feature_weight == 0:
        raise MoaspecError("--kl-weight and --feature-weight cannot both be 0: nothing would be learnt")
    return cfg


def drafter_sizes(args: argparse.Namespace, loaded: Any) -> dict[str, int | str | bool | None]:
    """One drafter's architecture options, checked against the loaded target."""
    if not 0 <= args.tli_layers < loaded.cfg.num_layers:
        raise MoaspecError(f"--tli-layers must be in 0..{loaded.cfg.num_layers - 1}")
    moa_sizes = (args.sa_mlp, args.ca_mlp, args.lsa_width, args.lsa_mlp)
    if args.kind != "moa" and (args.tli_layers or any(w is not None for w in moa_sizes) or args.no_lsa or args.memory_final
                               or args.newest_entry or args.derotate_keys):
        raise MoaspecError("--tli-layers, --sa-mlp, --ca-mlp, --lsa-width, --lsa-mlp, --no-lsa, --memory-final, "
                           "--newest-entry and --derotate-keys apply to MoA drafters only")
    if args.no_lsa and args.derotate_keys:
        raise MoaspecError("--derotate-keys changes Layer Self-Attention's input, which --no-lsa removes")
    if isinstance(args.lsa_width, int) and (args.lsa_width <= 0 or args.lsa_width % 64):
        raise MoaspecError(f"--lsa-width must be a positive multiple of 64 (LSA's heads are 64 wide), got {args.lsa_width}")
    if args.layers is not None and (args.kind != "independent" or not 1 <= args.layers < loaded.cfg.num_layers):
        raise MoaspecError(f"--layers applies to independent drafters and must be in 1..{loaded.cfg.num_layers - 1}")
    if args.draft_vocab > loaded.cfg.vocab_size:
        raise MoaspecError(f"--draft-vocab must be at most the target's vocabulary ({loaded.cfg.vocab_size}), "
                           f"or 0 for all of it; got {args.draft_vocab}")
    if args.kind == "moa":
        return {"sa_mlp": args.sa_mlp, "ca_mlp": args.ca_mlp, "lsa_width": args.lsa_width, "lsa_mlp": args.lsa_mlp,
                "memory_source": "last-layer" if args.no_lsa else "lsa+final" if args.memory_final else None,
                "newest_entry": True if args.newest_entry else None,
                "derotate_keys": True if args.derotate_keys else None}
    if args.kind == "independent":
        return {"layers": args.layers}
    return {}


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moaspec.fileio import check_output_dir
    from moaspec.training.trainer import RUN_FILES, RUN_MARKER, Trainer, train_together

    if args.time_limit is not None and not args.time_limit > 0:
        raise MoaspecError(f"--time-limit must be > 0 seconds; got {args.time_limit:g}")
    arms = drafter_settings(args)
    outputs = [Path(args.output) / name for name, _ in arms]  # one drafter: --output itself
    if arms[0][0] and (Path(args.output) / RUN_MARKER).is_file():  # named drafters: OUTPUT/NAME each
        raise MoaspecError(f"--output {args.output} holds a run of one drafter; drafters trained together each "
                           "get a directory under --output: name another")
    for out in outputs:
        check_output_dir(out, RUN_MARKER, RUN_FILES)
    configs = [train_config(ns) for _, ns in arms]  # before the target loads
    loaded = options.load_target(args)
    sizes = [drafter_sizes(ns, loaded) for _, ns in arms]
    trainers: list[Trainer] = []
    for (_, ns), out, cfg, size in zip(arms, outputs, configs, sizes):
        data = trainers[0].data if trainers else [Path(d) for d in args.data]  # the first drafter's, shared
        trainers.append(Trainer(loaded, data, out, cfg, size, progress=not args.no_progress, compile=ns.compile))
    summaries = train_together(trainers, time_limit=args.time_limit)
    if trainers[0].acc.is_main_process:
        for (name, _), out, summary in zip(arms, outputs, summaries):
            print(json.dumps({**({"drafter": name} if name else {}),
                              **{k: summary[k] for k in ("steps", "tokens", "wall_s", "last_val")}}))
            print(f"drafter written to {out / 'drafter'}")
    return 0
