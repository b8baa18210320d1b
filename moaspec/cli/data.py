"""``moaspec data``: make a distillation set, answers written by the target itself."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from moaspec.cli import options


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser("data", help="make a distillation set: answers written by the target itself, to prompts it "
                                    "writes (Magpie) or to yours (--prompts)")
    d.add_argument("--output", required=True, help="directory for shards and manifest.json (resumes if it exists)")
    d.add_argument("--examples", type=int, default=2000,
                   help="stop once at least this many assistant turns are written (shards are written whole, so the "
                        "last one may go past it)")
    d.add_argument("--shard-size", type=int, default=64, help="conversations started per shard")
    d.add_argument("--batch-size", type=int, default=32, help="sequences decoded together")
    d.add_argument("--max-query-tokens", type=int, default=96, help="budget of a written user prompt")
    d.add_argument("--max-passage-tokens", type=int, default=512,
                   help="longest text a summarisation or passage-question prompt pastes")
    d.add_argument("--max-answer-tokens", type=int, default=384)
    d.add_argument("--multi-turn", type=float, default=0.2, help="fraction of conversations with a second user turn")
    d.add_argument("--greedy-fraction", type=float, default=0.5, help="fraction of answers decoded greedily (rest sampled)")
    d.add_argument("--prompts", metavar="FILE",
                   help="your own conversations (JSON lines or a JSON array: ShareGPT, chat messages, "
                        '{"turns": [...]}, {"prompt": ...}, Alpaca, or strings): the target answers each user turn '
                        "instead of prompts it writes; the run ends when the file is used up")
    d.add_argument("--passages", metavar="PATH",
                   help="a text file, or a directory of .txt/.md/.rst files, whose paragraphs are pasted under the "
                        "summarisation and passage-question instructions instead of the target's own answers")
    d.add_argument("--pasted-fraction", type=float,
                   help="share of conversations that paste a text (default 2 of 7; 0 with --prompts gives your "
                        "prompts alone)")
    d.add_argument("--part", metavar="K/N",
                   help="take every N-th conversation of --prompts and passage of --passages, from the K-th on, so "
                        "that N data processes (each with its own --output and --seed) share the files")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-progress", action="store_true")
    options.add_model_options(d)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moaspec.fileio import check_output_dir
    from moaspec.training.datagen import MIN_PASSAGE_TOKENS, OUTPUT_FILES, OUTPUT_MARKER, DataConfig, generate_dataset
    from moaspec.training.user_text import load_user_text, parse_part

    check_output_dir(args.output, OUTPUT_MARKER, OUTPUT_FILES)

    options.require(args, ">= 1", options.at_least(1), "examples", "shard_size", "batch_size", "max_query_tokens",
                    "max_passage_tokens", "max_answer_tokens")
    options.require(args, "between 0 and 1", lambda v: 0 <= v <= 1, "multi_turn", "greedy_fraction", "pasted_fraction")
    part = None if args.part is None else parse_part(args.part)
    user = load_user_text(args.prompts, args.passages, args.max_passage_tokens, MIN_PASSAGE_TOKENS, part)
    cfg = DataConfig(
        examples=args.examples, shard_size=args.shard_size, batch_size=args.batch_size,
        max_query_tokens=args.max_query_tokens, max_passage_tokens=args.max_passage_tokens,
        max_answer_tokens=args.max_answer_tokens,
        multi_turn=args.multi_turn, greedy_fraction=args.greedy_fraction, seed=args.seed,
        pasted_fraction=args.pasted_fraction,
    )
    loaded = options.load_target(args)
    manifest = generate_dataset(loaded, Path(args.output), cfg, progress=not args.no_progress, user=user)
    records = sum(s["records"] for s in manifest["shards"])
    tokens = sum(s["answer_tokens"] for s in manifest["shards"])
    print(f"{args.output}: {records} assistant turns, {tokens} answer tokens in {len(manifest['shards'])} shards")
    if user.prompts:
        skipped = too_long(loaded, user.prompts, args.max_answer_tokens)
        if skipped:
            print(f"moaspec data: {skipped} of the {len(user.prompts)} conversations of {args.prompts} were skipped: "
                  f"their first turn leaves no room for --max-answer-tokens {args.max_answer_tokens} in the model's "
                  f"context ({loaded.cfg.max_position_embeddings} tokens)", file=sys.stderr)
        if records < args.examples:
            print(f"(all {len(user.prompts) - skipped} conversations of {args.prompts} that fit were used)")
    return 0


def too_long(loaded: Any, conversations: Sequence[Sequence[str]], answer_tokens: int) -> int:
    """How many ``conversations`` ``moaspec data`` leaves out: their first turn and an answer do not fit the context."""
    from moaspec.chat import encode_chat

    room = loaded.cfg.max_position_embeddings - answer_tokens
    return sum(len(encode_chat(loaded.tokenizer, [{"role": "user", "content": turns[0]}])) > room
               for turns in conversations)
