"""``moaspec generate``: answer a prompt (or hold a conversation) on this machine, streaming the text."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from moaspec.cli import options
from moaspec.cli.chat import DRAFT_COLOUR, RESET, Writer, chat_loop, chat_start, read_stdin, show
from moaspec.errors import MoaspecError

CHAT_CACHE_BYTES = 512 << 20  # the conversation's K/V: 46 KB a token for SmolLM2, so about 11,000 tokens
PREFILL_BAR_TOKENS = 2048  # prompts this long take seconds to read on a CPU (7,800 tokens: 23 s, 2 cores)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    g = sub.add_parser("generate", help="answer a chat prompt, streaming the text")
    g.add_argument("prompt", nargs="?", default=None, help="the user message ('-' reads it from stdin)")
    g.add_argument("--system", default=None, help="system message")
    g.add_argument("--messages", default=None, help="JSON file with a list of {role, content} messages (multi-turn)")
    g.add_argument("--raw", action="store_true", help="plain completion of the prompt text, no chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token counts, tau, timings) instead of streaming")
    options.add_logprobs_option(g)
    g.add_argument("--chat", action="store_true",
                   help="a conversation: after each answer, read the next message from stdin (/reset starts over, "
                        "/exit or end of input ends it); each turn reads only what is new of the conversation")
    g.add_argument("--drafter", default=None, help="drafter checkpoint directory (default: the one shipped for the target)")
    g.add_argument("--no-draft", action="store_true", help="plain decoding, one target forward per token")
    options.add_decoding_options(g)
    g.add_argument("--show-drafts", action="store_true", help="colour the text that came from accepted drafts")
    options.add_model_options(g)
    options.add_drafter_dtype_option(g)
    _add_generation_options(g)


def _add_generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256, help="stop after this many new tokens (default 256)")
    options.add_sampling_options(p)
    options.add_penalty_options(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def run(args: argparse.Namespace) -> int:
    from moaspec.api import encode_prompt
    from moaspec.chat import encode_chat
    from moaspec.decoding import GenerationConfig
    from moaspec.decoding.prefill import Prefill
    from moaspec.errors import PromptError

    messages = _read_messages(args)
    prompt = args.prompt
    if args.chat and (args.json or args.raw):
        raise MoaspecError("--chat streams a conversation in the chat template: not with --json or --raw")
    options.require_json_for_logprobs(args)
    if messages is None and not (args.chat and prompt is None):
        if prompt == "-":
            prompt = read_stdin()
        if prompt is None or not prompt.strip():
            raise PromptError("the prompt is empty")
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        sampling=options.sampling_params(args),
        stop=tuple(args.stop),
        logprobs=args.logprobs,
    )
    loaded = options.load_target(args)
    if args.chat:  # a prompt cache keeps what each turn read and wrote: the next reads only the new message
        from moaspec.decoding.prefill import PromptCache

        strategy, reuse = options.strategy_for(args, loaded), PromptCache(CHAT_CACHE_BYTES)

        def answer(ids: list[int], write: Writer) -> None:
            strategy.run(loaded, ids, config, on_piece=lambda text, drafted: write(text, DRAFT_COLOUR if drafted and
                         args.show_drafts else ""), prefill=Prefill(_prefill_bar(len(ids)), reuse))

        return chat_loop(loaded.tokenizer, answer, chat_start(args, messages, prompt))
    ids = encode_chat(loaded.tokenizer, messages) if messages is not None else encode_prompt(loaded, prompt, args.system,
                                                                                              args.raw)

    def coloured(text: str, drafted: bool) -> None:
        show(text, DRAFT_COLOUR if drafted else "")

    strategy = options.strategy_for(args, loaded)
    if args.show_drafts and not args.json and (strategy.drafter is not None or strategy.lookup):
        print(f"({DRAFT_COLOUR}accepted drafts{RESET}, target tokens plain)", file=sys.stderr)
    result = strategy.run(loaded, ids, config, on_text=None if args.json else show,
                          on_piece=coloured if args.show_drafts and not args.json else None,
                          prefill=Prefill(None if args.json else _prefill_bar(len(ids))))
    if args.json:
        out = {**result.to_dict(), "decoding": strategy.describe(),
               "costs_from": None if strategy.policy is None else strategy.policy.source}
        if result.logprobs is not None:
            out["logprobs"] = options.logprobs_json(loaded.tokenizer, result.logprobs)
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        if result.finish_reason == "length" and result.new_tokens < config.max_new_tokens:
            print(f"[moaspec: stopped after {result.new_tokens} tokens: the model's context window "
                  f"({loaded.cfg.max_position_embeddings} tokens) is full]", file=sys.stderr)
    return 0


def _read_messages(args: argparse.Namespace) -> list[dict[str, str]] | None:
    if args.messages is None:
        return None
    if args.prompt is not None:
        raise MoaspecError("give either a prompt or --messages, not both")
    if args.system is not None or args.raw:
        raise MoaspecError("--messages carries its own system message and chat template: --system and --raw apply "
                           "to a single prompt")
    try:
        with open(args.messages, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise MoaspecError(f"cannot read {args.messages}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise MoaspecError(f"{args.messages} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise MoaspecError(f"{args.messages} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, list):
        raise MoaspecError(f"{args.messages} must hold a JSON list of messages")
    return data


def _prefill_bar(prompt_tokens: int) -> Callable[[int, int], None] | None:
    """A progress bar on a terminal while a long prompt is read, so the wait before the answer is not silent; it
    disappears when the answer starts."""
    if prompt_tokens < PREFILL_BAR_TOKENS or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    bar = tqdm(total=prompt_tokens, desc="reading the prompt", unit="tok", leave=False, file=sys.stderr, mininterval=0)

    def update(done: int, total: int) -> None:
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update
