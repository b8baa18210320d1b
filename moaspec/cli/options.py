"""What several commands share: option validators, option groups, and the objects options describe
(the target, the decoding strategy, a benchmark's settings)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from moaspec.errors import MoaspecError

if TYPE_CHECKING:  # imported where used: the command line starts without torch
    from moaspec.decoding.generation import TokenLogprob
    from moaspec.decoding.sampling import SamplingParams


def require(args: argparse.Namespace, rule: str, holds: Callable[[Any], bool], *names: str) -> None:
    """Refuse the first option of ``names`` whose value (when given) breaks ``rule``, naming it and its value."""
    for name in names:
        value = getattr(args, name)
        if value is not None and not holds(value):
            raise MoaspecError(f"--{name.replace('_', '-')} must be {rule}, got {value}")


def at_least(low: float) -> Callable[[Any], bool]:
    return lambda v: v >= low  # False for NaN


def finite_positive(v: float) -> bool:
    return math.isfinite(v) and v > 0


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return n


def add_model_options(p: argparse.ArgumentParser, threads: str = "torch's choice") -> None:
    from moaspec.drafters.checkpoint import DTYPE_CHOICES

    p.add_argument("--model", default=None, help="model: 'smollm2' (default, embedded), a .gguf file, or a local HF model directory")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=_positive_int, default=None, help=f"CPU threads for torch (default: {threads})")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="the target's weights and activations (default: float32 on every device, where greedy "
                        "speculative output equals vanilla's token for token; bfloat16/float16 are faster on GPUs but "
                        "round a verification differently from one-token steps, so answers can part at near-ties)")
    p.add_argument("--dense-weights", action="store_true",
                   help="run a GGUF target on its dequantised fp32 weights alone (by default a CPU decodes from the "
                        "file's own 4-bit and 8-bit blocks, in fp32 arithmetic: about twice as fast)")


def add_drafter_dtype_option(p: argparse.ArgumentParser) -> None:
    from moaspec.drafters.checkpoint import DRAFTER_DTYPE_CHOICES

    p.add_argument("--drafter-dtype", choices=DRAFTER_DTYPE_CHOICES, default=None,
                   help="the drafters' weights and activations (default 'auto': int8 weights with bf16 activations on "
                        "CPUs with oneDNN bf16 kernels; on other CPUs, beside an fp32 target, 8-bit weight blocks with "
                        "fp32 activations and compiled layers; else the target's dtype; 'int8': 8-bit weights on any "
                        "CPU); never changes the text, only which drafts are accepted")


def add_sampling_options(p: argparse.ArgumentParser, seed_help: str = "seed for sampling") -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=None, help=seed_help)


def add_penalty_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="lower the logits of tokens the answer already holds by this much (-2..2, as OpenAI's)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="lower the logits of tokens the answer already holds by this much per occurrence (-2..2)")


def add_logprobs_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json: each token's log-probability under the target and the K (0-20) most likely "
                        "tokens at its position, as OpenAI's chat API gives them")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The :class:`~moaspec.decoding.sampling.SamplingParams` of the sampling and penalty options."""
    from moaspec.decoding import SamplingParams

    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed, args.presence_penalty,
                          args.frequency_penalty)


def logprobs_json(tokenizer: Any, logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """``--json``'s ``logprobs``: the entries as OpenAI's chat API's ``content`` list."""
    from moaspec.decoding.logprobs import LogprobFormat, TokenBytes

    return (LogprobFormat(TokenBytes(tokenizer), chat=True)(logprobs) or {}).get("content", [])


def require_json_for_logprobs(args: argparse.Namespace) -> None:
    if args.logprobs is not None and not args.json:
        raise MoaspecError("--logprobs adds each token's log-probability to --json's output: give --json too")


def default_chain() -> int:
    from moaspec.decoding.speculative import DEFAULT_CHAIN

    return DEFAULT_CHAIN


def default_lookup() -> int:
    from moaspec.decoding.lookup import DEFAULT_LOOKUP

    return DEFAULT_LOOKUP


def _probability(text: str) -> float:
    try:
        p = float(text)
    except ValueError:
        p = -1.0
    if not 0 <= p < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a probability in [0, 1)")
    return p


def add_confidence_option(p: argparse.ArgumentParser, tunable: bool = False) -> None:
    """``tunable``: left out, the option is None, so that the settings `moaspec tune` saved may apply."""
    from moaspec.decoding.speculative import DEFAULT_CONFIDENCE

    p.add_argument("--draft-confidence", type=_probability, default=None if tunable else DEFAULT_CONFIDENCE, metavar="P",
                   help="end a chain early (chains only): drafts after the first only while the drafter gives its "
                        f"likeliest token probability >= P, so --chain is the most per forward (0: off; default "
                        f"{DEFAULT_CONFIDENCE:g})")


def _add_lookup_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lookup", type=int, default=None, metavar="N",
                   help="prompt lookup: up to N drafts copied from where the newest tokens occurred before, before the "
                        "drafter's chain (which drafts only where nothing matches) or grafted onto its tree; "
                        f"0: off (default {default_lookup()}; with --no-draft 0, and N > 0 runs lookup alone)")


def add_tree_options(p: argparse.ArgumentParser) -> None:
    from moaspec.decoding.tree import TreeShape

    d = TreeShape()
    p.add_argument("--tree-depth", type=int, default=None, help=f"tree levels below the newest token (default {d.depth})")
    p.add_argument("--tree-top-k", type=int, default=None, help=f"nodes expanded per level and children per node (default {d.top_k})")
    p.add_argument("--tree-total", type=int, default=None, help=f"tree nodes verified per target forward (default {d.total})")


def tree_knobs(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The tree ``--tree-depth``, ``--tree-top-k`` and ``--tree-total`` describe, the rest from the defaults."""
    from moaspec.decoding.tree import TreeShape

    d = TreeShape()
    return TreeShape(d.depth if args.tree_depth is None else args.tree_depth,
                     d.top_k if args.tree_top_k is None else args.tree_top_k,
                     d.total if args.tree_total is None else args.tree_total)


def tree_shape(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The tree the options ask for (``--tree`` and its knobs), or None for chains."""
    if args.tree:
        return tree_knobs(args)
    if any(getattr(args, k) is not None for k in ("tree_depth", "tree_top_k", "tree_total")):
        raise MoaspecError("--tree-depth, --tree-top-k and --tree-total shape a tree: add --tree")
    return None


def add_decoding_options(p: argparse.ArgumentParser) -> None:
    """How ``generate`` and ``serve`` decode with a drafter; left out, cost-aware (:mod:`moaspec.decoding.policy`)."""
    p.add_argument("--chain", type=int, default=None, metavar="T",
                   help=f"chain drafting: T drafts per target forward (default {default_chain()} with --policy fixed; "
                        "by cost, the most the drafter may draft per cycle)")
    add_confidence_option(p, tunable=True)
    p.add_argument("--tree", action="store_true", help="EAGLE-2 dynamic-tree drafting instead of a chain")
    add_tree_options(p)
    _add_lookup_option(p)
    p.add_argument("--policy", choices=("cost", "fixed"), default=None,
                   help="cost: decide each cycle from this host's measured costs and the answer's acceptance whether to "
                        "verify lookup's copy, let the drafter draft (and how far) or take a plain step, with --chain "
                        "and --lookup as caps; fixed: draft exactly as the options say (default: cost when no decoding "
                        "option is given, else fixed)")


def strategy_for(args: argparse.Namespace, loaded):  # type: ignore[no-untyped-def]
    """The decoding the options ask for: the given or shipped drafter, chain or tree, prompt lookup; or none."""
    from moaspec.api import SHIPPED, decoding_strategy

    if args.lookup is not None and args.lookup < 0:
        raise MoaspecError("--lookup must be >= 0 (0: off)")
    if args.chain is not None and args.chain < 1:
        raise MoaspecError("--chain must be >= 1")
    if args.chain is not None and args.tree:
        raise MoaspecError("--chain and --tree are two ways to draft: give one")

    def notify(message: str) -> None:
        print(f"moaspec: {message} (to get one: `moaspec data` writes the target's answers, `moaspec train` learns "
              "from them, then pass --drafter)", file=sys.stderr)

    return decoding_strategy(loaded, None if args.no_draft else args.drafter or SHIPPED, chain=args.chain,
                             tree=tree_shape(args), lookup=args.lookup, confidence=args.draft_confidence,
                             by_cost=None if args.policy is None else args.policy == "cost", notify=notify)


def load_target(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The target ``--model``, ``--device`` and ``--dtype`` name, with ``--threads`` and ``--drafter-dtype`` set first."""
    import torch

    from moaspec.models import load_model

    if args.threads:
        from moaspec.cores import usable_cores

        cores = usable_cores()
        if args.threads > cores:
            print(f"moaspec: warning: --threads {args.threads} is more than the {cores} cores this process may use; "
                  "threads that wait for a core slow every step", file=sys.stderr)
        torch.set_num_threads(args.threads)
    if getattr(args, "dense_weights", False):  # read where targets load, here and in any server process started
        from moaspec.models.gguf_blocks import BLOCKS_ENV

        os.environ[BLOCKS_ENV] = "0"
    if getattr(args, "drafter_dtype", None):  # read where drafters load, here and in any server process started
        from moaspec.drafters.checkpoint import DTYPE_VARIABLE

        os.environ[DTYPE_VARIABLE] = args.drafter_dtype
    return load_model(args.model, device=args.device, dtype=args.dtype)


def method_list(text: str) -> list[str]:
    """``--methods`` of bench and bench-cs: a comma list of distinct names (each command checks the names)."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names or len(set(names)) != len(names):
        raise MoaspecError("--methods needs a comma list of distinct methods")
    return names


def bench_settings(args: argparse.Namespace, loaded, *skip: str) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The options that shape a benchmark's methods, recorded in its summary (and checked when it resumes),
    with the dtypes and device the target and drafters actually ran in rather than "auto": a half-precision
    target's greedy answers may part from vanilla's, so a reader of the figures must see which it was."""
    from moaspec.drafters.base import precision_name
    from moaspec.drafters.checkpoint import drafting_precision

    settings = {k: v for k, v in vars(args).items() if k not in ("output", "no_progress", *skip)}
    settings["drafter_dtype"] = precision_name(*drafting_precision(loaded))
    settings["target_dtype"] = str(loaded.model.dtype).removeprefix("torch.")
    settings["target_device"] = str(loaded.model.device)
    settings["target_products"] = products_path(loaded.model)
    return settings


def products_path(model) -> str:  # type: ignore[no-untyped-def]
    """What a decoding step's products read: "gguf-blocks" (the file's 4-bit/8-bit blocks, fp32 arithmetic) where
    every linear layer has them, "dense" where none has, else how many do."""
    from moaspec.models.packed_linear import Linear

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    with_blocks = sum(m.blocks is not None for m in linears)
    if with_blocks == len(linears):
        return "gguf-blocks"
    return "dense" if with_blocks == 0 else f"gguf-blocks for {with_blocks} of {len(linears)} layers"
