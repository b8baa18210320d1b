"""What the SpecBench scripts here share: their common options, the target and drafter
those name, and writing the results file (atomically, so a stopped run leaves none).

Not run on its own; it is imported by the SpecBench scripts beside it, for example:

    .venv/bin/python benchmarks/chain_tau.py --per-file 10 --max-new-tokens 128 --no-vanilla --threads 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from moaspec.drafters import shipped_drafter
from moaspec.fileio import atomic_write_text
from moaspec.models import LoadedModel, load_model
from moaspec.specbench import Question, load_questions

REPO = Path(__file__).resolve().parent.parent


def parser(doc: str | None, per_file: int) -> argparse.ArgumentParser:
    """A parser with --model, --questions, --per-file, --drafter, --threads and --output; the script adds its own."""
    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    ap.add_argument("--model", default=None, help="the target: a GGUF file or model directory (default: the default "
                                                  "model, SmolLM2-135M-Instruct as Q4_1)")
    ap.add_argument("--questions", default=str(REPO.parent / "shared" / "specbench"))
    ap.add_argument("--per-file", type=int, default=per_file, help="the first K questions of each file")
    ap.add_argument("--skip", type=int, default=0,
                    help="leave out the first K questions of each file first (--skip 10 --per-file 10: the next ten)")
    ap.add_argument("--drafter", default=None, help="drafter checkpoint directory (default: the shipped MoA drafter)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default=None, help="write the arguments and results as JSON here")
    return ap


def add_penalty_arguments(ap: argparse.ArgumentParser) -> None:
    """--presence and --frequency: the presence and frequency penalties a script times decoding under."""
    ap.add_argument("--presence", type=float, default=0.5)
    ap.add_argument("--frequency", type=float, default=0.5)


def questions(args: argparse.Namespace) -> list[Question]:
    """The questions ``--questions``, ``--skip`` and ``--per-file`` select."""
    return load_questions(args.questions, per_file=args.per_file, skip=args.skip)


def target_and_drafter_path(args: argparse.Namespace) -> tuple[LoadedModel, str]:
    """The target ``--model`` names on this CPU with ``--threads`` threads, and the drafter to load for it."""
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, device="cpu")
    return lm, str(args.drafter or shipped_drafter(lm))


def write_results(args: argparse.Namespace, **results: Any) -> None:
    if args.output:
        atomic_write_text(args.output, json.dumps({"args": vars(args), **results}, indent=1))
