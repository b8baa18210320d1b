"""``moaspec data``: make a distillation set, answers written by the target itself."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from moaspec.cli import options
from moaspec.errors import MoaspecError
from moaspec.training.user_text import BALANCES


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
    d.add_argument("--prompts", metavar="PATH", nargs="+",
                   help="your own conversations: files, or directories whose every .jsonl/.json file is read (JSON "
                        'lines or a JSON array: ShareGPT, chat messages, {"turns": [...]}, {"prompt": ...}, Alpaca, '
                        'or strings; an object may name its "category"): the target answers each user turn instead '
                        "of prompts it writes; the run ends when they are used up")
    d.add_argument("--balance", choices=BALANCES,
                   help="how --prompts are taken: answer-tokens (the default where they name categories) takes each "
                        "next conversation from the category whose answers hold the fewest tokens so far, so that "
                        "long and short answers get a like share; none takes them in file order (the default "
                        "otherwise). A conversation without a category belongs to one named after its file")
    d.add_argument("--categories", metavar="A,B,...",
                   help="answer the --prompts of these categories only")
    d.add_argument("--max-turns", type=int, metavar="N",
                   help="answer at most this many user turns of a --prompts conversation (default: all, each in "
                        "turn while the conversation fits the model's context)")
    d.add_argument("--exclude-questions", metavar="PATH",
                   help="leave out every --prompts conversation and --passages passage that overlaps a question of "
                        "these SpecBench-format .jsonl files (a directory of them, e.g. SpecBench's): the same text "
                        "once lower-cased with punctuation removed, or 60 characters in a row in common")
    d.add_argument("--passages", metavar="PATH",
                   help="a text file, or a directory of .txt/.md/.rst files, whose paragraphs are pasted under the "
                        "summarisation and passage-question instructions instead of the target's own answers")
    d.add_argument("--pasted-fraction", type=float,
                   help="share of conversations that paste a text (default 2 of 7; 0 with --prompts gives your "
                        "prompts alone)")
    d.add_argument("--part", metavar="K/N",
                   help="take every N-th conversation of --prompts (of all its files together, after --categories "
                        "and --exclude-questions) and passage of --passages, from the K-th on, so that N data "
                        "processes (each with its own --output and --seed) share the files")
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
                    "max_passage_tokens", "max_answer_tokens", "max_turns")
    options.require(args, "between 0 and 1", lambda v: 0 <= v <= 1, "multi_turn", "greedy_fraction", "pasted_fraction")
    for name in ("balance", "categories", "max_turns"):
        if getattr(args, name) is not None and args.prompts is None:
            raise MoaspecError(f"--{name.replace('_', '-')} applies to the conversations of --prompts; give it")
    part = None if args.part is None else parse_part(args.part)
    categories = None if args.categories is None else category_list(args.categories)
    user = load_user_text(args.prompts, args.passages, args.max_passage_tokens, MIN_PASSAGE_TOKENS, part,
                          categories, args.exclude_questions)
    prompts = " ".join(args.prompts or ())
    if args.exclude_questions is not None:
        print(f"moaspec data: left out {user.about.get('excluded_conversations', 0)} conversation(s) of {prompts or '-'}"
              f" and {user.about.get('excluded_passages', 0)} passage(s) that overlap a question of "
              f"{args.exclude_questions}")
    balance = args.balance or ("answer-tokens" if user.categorised else "none")
    cfg = DataConfig(
        examples=args.examples, shard_size=args.shard_size, batch_size=args.batch_size,
        max_query_tokens=args.max_query_tokens, max_passage_tokens=args.max_passage_tokens,
        max_answer_tokens=args.max_answer_tokens,
        multi_turn=args.multi_turn, greedy_fraction=args.greedy_fraction, seed=args.seed,
        pasted_fraction=args.pasted_fraction, balance=None if balance == "none" else balance, max_turns=args.max_turns,
    )
    loaded = options.load_target(args)
    manifest = generate_dataset(loaded, Path(args.output), cfg, progress=not args.no_progress, user=user)
    records = sum(s["records"] for s in manifest["shards"])
    tokens = sum(s["answer_tokens"] for s in manifest["shards"])
    print(f"{args.output}: {records} assistant turns, {tokens} answer tokens in {len(manifest['shards'])} shards")
    if "prompts" in manifest:
        print(category_shares(manifest["prompts"]))
    if user.prompts and records < args.examples:  # the prompts are used up (else most were never reached)
        skipped = too_long(loaded, user.prompts, args.max_answer_tokens)
        if skipped:
            print(f"moaspec data: {skipped} of the {len(user.prompts)} conversations of {prompts} were skipped: "
                  f"their first turn leaves no room for --max-answer-tokens {args.max_answer_tokens} in the model's "
                  f"context ({loaded.cfg.max_position_embeddings} tokens)", file=sys.stderr)
        print(f"(all {len(user.prompts) - skipped} conversations of {prompts} that fit were used)")
    return 0


def category_list(text: str) -> list[str]:
    """``--categories a,b``, each named once."""
    names = [c.strip() for c in text.split(",")]
    if not all(names) or len(set(names)) != len(names):
        raise MoaspecError(f"--categories must be names separated by commas, each once, got {text!r}")
    return names


def category_shares(prompts: dict[str, Any]) -> str:
    """The answer tokens each category of the prompts has given, and its share, in one line."""
    counts = prompts["categories"]
    total = sum(c["answer_tokens"] for c in counts.values()) or 1
    since = f" (shards {prompts['counted_from_shard']} on)" if prompts["counted_from_shard"] else ""
    return (f"answer tokens by category{since}, {prompts['balance']} balance: "
            + ", ".join(f"{name} {c['answer_tokens']} ({100 * c['answer_tokens'] / total:.0f}%, "
                        f"{c['answered']} conversations)" for name, c in counts.items()))


def too_long(loaded: Any, conversations: Sequence[Sequence[str]], answer_tokens: int) -> int:
    """How many ``conversations`` ``moaspec data`` leaves out: their first turn and an answer do not fit the context."""
    from moaspec.chat import encode_chat

    room = loaded.cfg.max_position_embeddings - answer_tokens
    return sum(len(encode_chat(loaded.tokenizer, [{"role": "user", "content": turns[0]}])) > room
               for turns in conversations)
