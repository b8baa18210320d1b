"""``moaspec export-hf``: an independent drafter as a standalone transformers model."""

from __future__ import annotations

import argparse

from moaspec.cli import options
from moaspec.errors import MoaspecError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    h = sub.add_parser("export-hf", help="write an independent drafter as a standalone transformers model directory")
    h.add_argument("--drafter", required=True, help="independent drafter (`moaspec train --kind independent`)")
    h.add_argument("--output", required=True, help="directory for config.json, model.safetensors and the tokenizer")
    options.add_model_options(h)


def run(args: argparse.Namespace) -> int:
    """The independent drafter as a plain ``LlamaForCausalLM`` directory, e.g. an ``assistant_model`` elsewhere."""
    from pathlib import Path

    from moaspec.drafters import load_drafter
    from moaspec.drafters.independent import IndependentDrafter, to_hf_llama
    from moaspec.fileio import atomic_write_dir

    loaded = options.load_target(args)
    drafter = load_drafter(args.drafter, loaded, loaded.model.dtype)  # the checkpoint's precision, not drafting's
    if not isinstance(drafter, IndependentDrafter):
        raise MoaspecError(f"{args.drafter} is not an independent drafter: only those are standalone language models")
    model = to_hf_llama(drafter)

    def write(tmp: Path) -> None:
        model.save_pretrained(str(tmp), safe_serialization=True)
        loaded.tokenizer.save_pretrained(str(tmp))

    atomic_write_dir(args.output, write, marker="config.json")
    print(f"transformers model in {args.output} ({drafter.cfg.layers} layers; load it with "
          "AutoModelForCausalLM.from_pretrained)")
    return 0
