"""Your own prompts and documents for `moaspec data`, read and checked before any decoding.

A drafter learns best on the traffic it will serve. EAGLE and the MoA paper distil on
ShareGPT prompts whose answers the target writes again; a user deploying on their own
domain has their own prompt logs and documents. So `moaspec data` can take
``--prompts FILE`` (conversations whose user turns are kept and whose assistant turns,
if any, are thrown away: the target answers every turn itself) and ``--passages PATH``
(text pasted under the summarisation and passage-question instructions instead of the
target's own earlier answers).

Prompt files are JSON lines or one JSON array, each item one of:

- ``{"turns": ["first user turn", "second", ...]}`` (MT-bench and SpecBench questions),
- ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}, ...]}`` (ShareGPT),
- ``{"messages": [{"role": "user", "content": ...}, ...]}`` (chat messages),
- ``{"prompt": "..."}``, ``{"instruction": "...", "input": "..."}`` (Alpaca), or a bare string.

``--part K/N`` gives one of N processes every N-th conversation and passage, starting
with the K-th, so that several `moaspec data` processes (one per GPU, say) share a file
instead of each answering all of it.

Passages are read from a text file, or from every ``.txt``, ``.md`` and ``.rst`` file
under a directory (sorted, so the order never depends on the file system), split at
blank lines, and packed paragraph by paragraph into passages of at most about
``max_chars`` characters.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moaspec.errors import MoaspecError

PASSAGE_SUFFIXES = (".txt", ".md", ".rst")
USER_ROLES = ("human", "user")  # ShareGPT's "from" and chat messages' "role" for the user's turns
MAX_ITEM_ERRORS = 3  # errors quoted before giving up on a prompt file


@dataclass(frozen=True)
class UserText:
    """What `moaspec data` takes from the user; empty means the target writes it (Magpie)."""

    prompts: tuple[tuple[str, ...], ...] = ()  # each conversation's user turns, in file order
    passages: tuple[str, ...] = ()
    identity: tuple[tuple[str, Any], ...] = ()  # what a data directory records of them (hashes, counts)


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MoaspecError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise MoaspecError(f"{what} {path} is a directory; name a file") from None
    except UnicodeDecodeError:
        raise MoaspecError(f"{what} {path} is not UTF-8 text") from None
    except OSError as exc:
        raise MoaspecError(f"{what} {path} cannot be read ({exc.strerror})") from None


def _json_items(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    """(where, item) for each item of a JSON array or of JSON lines."""
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MoaspecError(f"prompt file {path} is not valid JSON ({exc.msg}: line {exc.lineno}, "
                               f"column {exc.colno})") from None
        for k, item in enumerate(items):
            yield f"item {k + 1}", item
        return
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"line {n}", json.loads(line)
        except json.JSONDecodeError as exc:
            raise MoaspecError(f"prompt file {path}: line {n} is not valid JSON ({exc.msg}); the file must be "
                               "JSON lines or one JSON array") from None


def user_turns(item: Any) -> tuple[str, ...] | None:
    """The user turns of one prompt-file item, or None when it has no recognised form.

    A conversation is cut at its first empty user turn: the turns after it would answer
    a question that was never asked.
    """
    if isinstance(item, str):
        turns: list[Any] = [item]
    elif not isinstance(item, dict):
        return None
    elif isinstance(item.get("turns"), list):
        turns = item["turns"]
    elif isinstance(item.get("conversations"), list):
        turns = [m.get("value") for m in item["conversations"] if isinstance(m, dict) and m.get("from") in USER_ROLES]
    elif isinstance(item.get("messages"), list):
        turns = [m.get("content") for m in item["messages"] if isinstance(m, dict) and m.get("role") in USER_ROLES]
    elif isinstance(item.get("prompt"), str):
        turns = [item["prompt"]]
    elif isinstance(item.get("instruction"), str):
        extra = item.get("input")
        turns = [item["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else "")]
    else:
        return None
    if not all(isinstance(t, str) for t in turns):
        return None
    kept: list[str] = []
    for t in turns:
        if not t.strip():
            break
        kept.append(t.strip())
    return tuple(kept)


def read_prompts(path: Path) -> tuple[tuple[tuple[str, ...], ...], str]:
    """Every conversation's user turns in ``path`` and a sha256 of the file's text (read once for both); refuses
    a file with unreadable items, naming them."""
    text = _read_text(path, "prompt file")
    conversations: list[tuple[str, ...]] = []
    bad: list[str] = []
    for where, item in _json_items(path, text):
        turns = user_turns(item)
        if turns is None:
            bad.append(where)
        elif turns:
            conversations.append(turns)
    if bad:
        shown = ", ".join(bad[:MAX_ITEM_ERRORS]) + (f" and {len(bad) - MAX_ITEM_ERRORS} more" if len(bad) > MAX_ITEM_ERRORS else "")
        raise MoaspecError(
            f"prompt file {path}: {shown} {'is' if len(bad) == 1 else 'are'} not a prompt. Each item must be a string "
            'or an object with "turns" (a list of strings), "conversations" (ShareGPT), "messages" (role/content), '
            '"prompt" or "instruction"'
        )
    if not conversations:
        raise MoaspecError(f"prompt file {path} holds no prompt")
    return tuple(conversations), hashlib.sha256(text.encode()).hexdigest()


def passage_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.exists():
        raise MoaspecError(f"passages {path} do not exist")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in PASSAGE_SUFFIXES)
    if not files:
        raise MoaspecError(f"passages: {path} holds no {', '.join(PASSAGE_SUFFIXES)} file")
    return files


def pack_paragraphs(text: str, max_chars: int, min_chars: int) -> list[str]:
    """Consecutive paragraphs joined into passages of at most ``max_chars`` (a longer paragraph stands alone,
    to be cut to the token budget where it is pasted); passages shorter than ``min_chars`` are dropped."""
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text.replace("\r\n", "\n")) if p.strip()]
    passages: list[str] = []
    current = ""
    for p in paragraphs:
        if current and len(current) + 2 + len(p) > max_chars:
            passages.append(current)
            current = ""
        current = f"{current}\n\n{p}" if current else p
    if current:
        passages.append(current)
    return [p for p in passages if len(p) >= min_chars]


def read_passages(path: Path, max_chars: int, min_chars: int) -> tuple[tuple[str, ...], str]:
    """The passages under ``path`` and a sha256 of what they were cut from (files' names and contents)."""
    digest = hashlib.sha256()
    passages: list[str] = []
    for f in passage_files(path):
        text = _read_text(f, "passage file")
        digest.update(f"{f.relative_to(path) if f != path else f.name}\0{text}\0".encode())
        passages.extend(pack_paragraphs(text, max_chars, min_chars))
    if not passages:
        raise MoaspecError(f"passages: {path} holds no paragraph of at least {min_chars} characters")
    return tuple(passages), digest.hexdigest()


def parse_part(text: str) -> tuple[int, int]:
    """``"K/N"`` (the K-th of N parts, 1 <= K <= N) as ``(K, N)``."""
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise MoaspecError(f"--part must be K/N with 1 <= K <= N (for example 2/4), got {text!r}")
    return int(k), int(n)


def _take_part(items: tuple[Any, ...], part: tuple[int, int] | None, what: str, path: str | Path) -> tuple[Any, ...]:
    """Every N-th item from the K-th on (all of them without ``part``)."""
    if part is None:
        return items
    k, n = part
    mine = items[k - 1 :: n]
    if not mine:
        raise MoaspecError(f"--part {k}/{n}: {path} holds only {len(items)} {what}, none for part {k}")
    return mine


def load_user_text(prompts: str | Path | None, passages: str | Path | None, max_passage_tokens: int,
                   min_passage_tokens: int, part: tuple[int, int] | None = None) -> UserText:
    """Read ``--prompts`` and ``--passages`` (either may be None), or the ``part`` (K, N) of them this process takes.

    Passages are cut by characters, about four to a token, so that a large corpus needs no
    tokenising up front; the pasted text is cut to tokens later. The identity records the
    whole file's hash and the part, so a resumed run refuses another file or another part.
    """
    if part is not None and prompts is None and passages is None:
        raise MoaspecError("--part splits a --prompts or --passages file between processes; give one of them")
    identity: dict[str, Any] = {}
    conversations: tuple[tuple[str, ...], ...] = ()
    texts: tuple[str, ...] = ()
    if prompts is not None:
        conversations, digest = read_prompts(Path(prompts))
        conversations = _take_part(conversations, part, "conversations", prompts)
        identity["prompts"] = {"sha256": digest, "conversations": len(conversations)}
    if passages is not None:
        texts, digest = read_passages(Path(passages), 4 * max_passage_tokens, 4 * min_passage_tokens)
        texts = _take_part(texts, part, "passages", passages)
        identity["passages"] = {"sha256": digest, "passages": len(texts)}
    if part is not None:
        identity["part"] = list(part)
    return UserText(conversations, texts, tuple(identity.items()))
