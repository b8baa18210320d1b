"""What generate and client share at the terminal: a prompt from stdin, text streamed in colour, and the
``--chat`` conversation loop."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from typing import Any

from moaspec.errors import MoaspecError

DRAFT_COLOUR, UNVERIFIED_COLOUR, RESET = "\033[36m", "\033[33m", "\033[0m"


def read_stdin() -> str:
    """The prompt from stdin, as UTF-8 whatever the locale (whose own decoding may fail, or keep bad bytes)."""
    from moaspec.errors import PromptError

    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError:
        raise PromptError("the prompt is not valid UTF-8 text") from None


def show(text: str, colour: str = "") -> None:
    """Stream ``text`` to the terminal now, in ``colour`` (an ANSI code; "" for plain)."""
    sys.stdout.write(f"{colour}{text}{RESET}" if colour else text)
    sys.stdout.flush()


Writer = Callable[[str, str], None]  # (text, its colour) → the terminal, and the conversation


def chat_loop(tokenizer: Any, answer: Callable[[list[int], Writer], None], start: list[dict[str, str]]) -> int:
    """``--chat``: answer, then read the next message from stdin, until /exit or the end of input.

    Each turn's prompt is the whole conversation so far (``start`` then the turns); ``answer``
    streams the reply to it through its writer. Ctrl-C stops an answer (what it wrote stays in
    the conversation) or, at the prompt, ends the chat; a message the model's context no longer
    holds is refused and the chat goes on.
    """
    from moaspec.chat import encode_chat
    from moaspec.errors import PromptError

    history = list(start)
    tty = sys.stdin.isatty()
    if tty:
        import readline  # noqa: F401  (line editing and history for input())

        print("(a conversation: /reset starts over, /exit or Ctrl-D ends it, Ctrl-C stops an answer)", file=sys.stderr)
    while True:
        if not history or history[-1]["role"] != "user":
            try:
                line = input("> " if tty else "").strip()
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            if line in ("/exit", "/quit"):
                return 0
            if line == "/reset":
                history = [m for m in start if m["role"] == "system"]
                continue
            if not line:
                continue
            if re.fullmatch(r"/\w+", line):  # a mistyped command is not a message to the model
                print(f"(no command {line}: /reset starts over, /exit ends; //{line[1:]} sends {line} as a message)",
                      file=sys.stderr)
                continue
            history.append({"role": "user", "content": line[1:] if line.startswith("//") else line})
        written: list[str] = []

        def write(text: str, colour: str, written: list[str] = written) -> None:
            written.append(text)
            show(text, colour)

        try:
            answer(encode_chat(tokenizer, history), write)
        except KeyboardInterrupt:
            print(" [stopped]", end="", file=sys.stderr)
        except MoaspecError as exc:  # the conversation outgrew the context window, or no server answers
            history.pop()
            hint = "; /reset starts a new conversation" if isinstance(exc, PromptError) else ""
            print(f"[moaspec: {exc}{hint}]", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(written)})


def chat_start(args: argparse.Namespace, messages: list[dict[str, str]] | None, prompt: str | None) -> list[dict[str, str]]:
    """The conversation ``--chat`` begins with: ``--messages``, or the prompt (with ``--system``), or nothing."""
    from moaspec.chat import chat_messages, validate_messages

    if messages is not None:
        return validate_messages(messages)
    if prompt:
        return chat_messages(prompt, args.system)
    return [{"role": "system", "content": args.system}] if args.system else []
