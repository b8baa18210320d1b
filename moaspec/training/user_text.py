"""Your own prompts and documents for `moaspec data`, read and checked before any decoding.

A drafter learns best on the traffic it will serve. EAGLE and the MoA paper distil on
ShareGPT prompts whose answers the target writes again; a user deploying on their own
domain has their own prompt logs and documents. So `moaspec data` can take
``--prompts PATH...`` (conversations whose user turns are kept and whose assistant turns,
if any, are thrown away: the target answers every turn itself) and ``--passages PATH``
(text pasted under the summarisation and passage-question instructions instead of the
target's own earlier answers).

``--prompts`` takes files, or directories whose every ``.jsonl`` and ``.json`` file (not
those of subdirectories, sorted by name) is read. A prompt file is JSON lines or one JSON
array, each item one of:

- ``{"turns": ["first user turn", "second", ...]}`` (MT-bench and SpecBench questions),
- ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}, ...]}`` (ShareGPT),
- ``{"messages": [{"role": "user", "content": ...}, ...]}`` (chat messages),
- ``{"prompt": "..."}``, ``{"instruction": "...", "input": "..."}`` (Alpaca), or a bare string.

An object may name its ``category`` (``qa``, ``sum``...); a conversation without one
belongs to a category named after its file. `moaspec data` can then take conversations
category by category (``--balance``) and keep some categories only (``--categories``).

``--exclude-questions`` leaves out every conversation (and passage) that overlaps a
benchmark question, so that a drafter is never trained on what it is measured on (see
:class:`QuestionOverlap`).

``--part K/N`` gives one of N processes every N-th conversation and passage, starting
with the K-th, so that several `moaspec data` processes (one per GPU, say) share the files
instead of each answering all of them.

Passages are read from a text file, or from every ``.txt``, ``.md`` and ``.rst`` file
under a directory (sorted, so the order never depends on the file system), split at
blank lines, and packed paragraph by paragraph into passages of at most about
``max_chars`` characters.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moaspec.errors import MoaspecError

PASSAGE_SUFFIXES = (".txt", ".md", ".rst")
PROMPT_SUFFIXES = (".jsonl", ".json")
USER_ROLES = ("human", "user")  # ShareGPT's "from" and chat messages' "role" for the user's turns
MAX_ITEM_ERRORS = 3  # errors quoted before giving up on a prompt file
MAX_SOURCE_NAMES = 20  # the distinct "source" fields a file's description lists
BALANCES = ("answer-tokens", "none")  # `moaspec data --balance`: by category, for like answer tokens; file order


@dataclass(frozen=True)
class PromptFile:
    """One file that ``--prompts`` read, as a data directory's manifest describes it."""

    path: str  # relative to the directory given (or to the common folder of several paths; a lone file: its name)
    sha256: str
    bytes: int
    conversations: int  # read from it, before any is left out
    sources: tuple[str, ...] = ()  # the distinct "source" fields of its items (where they name one)


@dataclass(frozen=True)
class UserText:
    """What `moaspec data` takes from the user; empty means the target writes it (Magpie)."""

    prompts: tuple[tuple[str, ...], ...] = ()  # each conversation's user turns, in file order
    passages: tuple[str, ...] = ()
    identity: tuple[tuple[str, Any], ...] = ()  # what a data directory records of them (hashes, counts)
    categories: tuple[str, ...] = ()  # each conversation's category (its file's name where it names none)
    origins: tuple[int, ...] = ()  # each conversation's file, an index into ``files``
    files: tuple[PromptFile, ...] = ()
    categorised: bool = False  # some conversation names its category: `moaspec data` balances by category
    about: dict[str, Any] = field(default_factory=dict)  # what the manifest says of the prompts' sources


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


def item_category(item: Any) -> str | None:
    """An item's ``category``, or None where it names none; ValueError where it is not a name."""
    if not isinstance(item, dict) or item.get("category") is None:
        return None
    category = item["category"]
    if not (isinstance(category, str) and category.strip()):
        raise ValueError(category)
    return category.strip()


@dataclass(frozen=True)
class PromptFileText:
    """What one prompt file holds: its conversations' user turns, each one's category (None: unnamed), and the
    file as a manifest describes it."""

    conversations: tuple[tuple[str, ...], ...]
    categories: tuple[str | None, ...]
    file: PromptFile


def read_prompt_file(path: Path, name: str | None = None) -> PromptFileText:
    """Every conversation of ``path``, read once for the turns, categories and hash; refuses a file with unreadable
    items, naming them. ``name``: the path the description records (default: the file's name)."""
    text = _read_text(path, "prompt file")
    conversations: list[tuple[str, ...]] = []
    categories: list[str | None] = []
    sources: Counter[str] = Counter()
    bad: list[str] = []
    bad_category: list[str] = []
    for where, item in _json_items(path, text):
        turns = user_turns(item)
        try:
            category = item_category(item)
        except ValueError:
            bad_category.append(where)
            continue
        if turns is None:
            bad.append(where)
        elif turns:
            conversations.append(turns)
            categories.append(category)
            if isinstance(item, dict) and isinstance(item.get("source"), str):
                sources[item["source"]] += 1
    if bad:
        raise MoaspecError(
            f"prompt file {path}: {_some(bad)} {'is' if len(bad) == 1 else 'are'} not a prompt. Each item must be a "
            'string or an object with "turns" (a list of strings), "conversations" (ShareGPT), "messages" '
            '(role/content), "prompt" or "instruction"'
        )
    if bad_category:
        raise MoaspecError(f'prompt file {path}: the "category" of {_some(bad_category)} is not a name '
                           "(a non-empty string)")
    if not conversations:
        raise MoaspecError(f"prompt file {path} holds no prompt")
    described = PromptFile(name or path.name, hashlib.sha256(text.encode()).hexdigest(), len(text.encode()),
                           len(conversations), tuple(sorted(sources)[:MAX_SOURCE_NAMES]))
    return PromptFileText(tuple(conversations), tuple(categories), described)


def _some(where: list[str]) -> str:
    """The first few of ``where`` (items of a file), and how many more."""
    more = len(where) - MAX_ITEM_ERRORS
    return ", ".join(where[:MAX_ITEM_ERRORS]) + (f" and {more} more" if more > 0 else "")


def read_prompts(path: Path) -> tuple[tuple[tuple[str, ...], ...], str]:
    """Every conversation's user turns in ``path`` and a sha256 of the file's text."""
    read = read_prompt_file(path)
    return read.conversations, read.file.sha256


def prompt_files(paths: Sequence[str | Path]) -> list[tuple[Path, str]]:
    """The files ``--prompts`` names, each with the path its description records: the files given, and the
    ``.jsonl``/``.json`` files of each directory given (sorted by name), each once."""
    if not paths:
        raise MoaspecError("--prompts names no file or directory")
    found: list[Path] = []
    for given in map(Path, paths):
        if given.is_dir():
            inside = sorted(p for p in given.iterdir() if p.is_file() and p.suffix.lower() in PROMPT_SUFFIXES)
            if not inside:
                raise MoaspecError(f"prompts: {given} holds no {' or '.join(PROMPT_SUFFIXES)} file")
            found.extend(inside)
        elif given.exists():
            found.append(given)
        else:
            raise MoaspecError(f"prompt file {given} does not exist")
    real = [p.resolve() for p in found]
    twice = next((p for p, r in zip(found, real) if real.count(r) > 1), None)
    if twice is not None:
        raise MoaspecError(f"--prompts names {twice} twice (a file given again, or inside a directory given)")
    if len(paths) == 1:
        root = Path(paths[0]) if Path(paths[0]).is_dir() else Path(paths[0]).parent
    else:  # several: relative to the folder they share, so that no two are named alike
        root = Path(os.path.commonpath([str(p.parent.resolve()) for p in found]))
        found = real
    return [(p, p.relative_to(root).as_posix()) for p in found]


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


def overlap_text(text: str) -> str:
    """``text`` as overlaps are looked for in: lower case, every run of what is not a letter or digit one space."""
    return re.sub(r"[\W_]+", " ", text.lower()).strip()


class QuestionOverlap:
    """Which texts overlap a set of benchmark questions (every turn of each).

    A text overlaps a question when, both normalised by :func:`overlap_text`, they are equal
    or share any ``WINDOW`` characters in a row (a pasted article, a code stub, a reworded
    instruction around the same question), the rules that ../shared/prompts/README.md's
    "Overlap removal" applied. Found exactly, without comparing every window with every
    window: every ``KEY``-character window of the questions is indexed, and a text's
    windows are looked up every ``STRIDE`` characters (any run of ``WINDOW`` shared
    characters holds one of them), each hit then measured by extending it both ways.
    """

    WINDOW = 60
    STRIDE = 20
    KEY = WINDOW - STRIDE + 1

    def __init__(self, questions: Sequence[str]) -> None:
        self.texts = [overlap_text(q) for q in questions]
        self.exact = {t for t in self.texts if t}
        self.keys: dict[str, list[tuple[int, int]]] = {}
        for i, t in enumerate(self.texts):
            for at in range(len(t) - self.KEY + 1):
                self.keys.setdefault(t[at : at + self.KEY], []).append((i, at))

    def overlaps(self, text: str) -> bool:
        t = overlap_text(text)
        if t in self.exact:
            return True
        for at in range(0, len(t) - self.KEY + 1, self.STRIDE):
            for i, q_at in self.keys.get(t[at : at + self.KEY], ()):
                if self._shared_run(t, at, self.texts[i], q_at) >= self.WINDOW:
                    return True
        return False

    def _shared_run(self, t: str, at: int, q: str, q_at: int) -> int:
        """The length of the run of characters ``t`` and ``q`` share around the window at ``at`` and ``q_at``."""
        before = 0
        while before < min(at, q_at) and t[at - before - 1] == q[q_at - before - 1]:
            before += 1
        after = self.KEY
        while at + after < len(t) and q_at + after < len(q) and t[at + after] == q[q_at + after]:
            after += 1
        return before + after


def read_questions(path: str | Path) -> tuple[QuestionOverlap, str, int]:
    """The overlap test for the SpecBench-format questions at ``path`` (a .jsonl file or a directory of them), a
    sha256 of their turns, and how many questions there are."""
    from moaspec.specbench import load_questions

    questions = load_questions(path)
    turns = [t for q in questions for t in q.turns]
    digest = hashlib.sha256("\0".join(turns).encode()).hexdigest()
    return QuestionOverlap(turns), digest, len(questions)


@dataclass(frozen=True)
class PromptChoice:
    """Which of the conversations read `moaspec data` answers: ``categories`` (None: all), none that overlaps
    ``exclude`` (questions), this process's ``part`` (K, N) of the rest."""

    categories: tuple[str, ...] | None = None
    exclude: QuestionOverlap | None = None
    part: tuple[int, int] | None = None


def load_prompts(paths: Sequence[str | Path], choice: PromptChoice) -> tuple[UserText, dict[str, Any]]:
    """The conversations of ``paths`` that ``choice`` keeps, and what a data directory's identity records of them."""
    files = [read_prompt_file(path, name) for path, name in prompt_files(paths)]
    rows = [(turns, category if category is not None else Path(f.file.path).stem, k)
            for k, f in enumerate(files) for turns, category in zip(f.conversations, f.categories)]
    given = ", ".join(map(str, paths))
    if choice.categories is not None:
        present = sorted({category for _, category, _ in rows})
        unknown = [c for c in choice.categories if c not in present]
        if unknown:
            raise MoaspecError(f"--categories: no conversation of {given} is in {', '.join(map(repr, unknown))}; "
                               f"its categories are {', '.join(present)}")
        rows = [row for row in rows if row[1] in choice.categories]
    excluded: Counter[int] = Counter()
    if choice.exclude is not None:
        leaks = [any(map(choice.exclude.overlaps, turns)) for turns, _, _ in rows]
        excluded.update(k for (_, _, k), leak in zip(rows, leaks) if leak)
        rows = [row for row, leak in zip(rows, leaks) if not leak]
        if not rows:
            raise MoaspecError(f"every conversation of {given} overlaps a question of --exclude-questions")
    rows = list(_take_part(tuple(rows), choice.part, "conversations", given))
    kept = Counter(k for _, _, k in rows)
    by_category = Counter(category for _, category, _ in rows)
    identity: dict[str, Any] = {"conversations": len(rows)}
    if len(files) == 1 and not Path(paths[0]).is_dir():  # as a data directory made from one file has always said
        identity["sha256"] = files[0].file.sha256
    else:
        identity["sha256"] = hashlib.sha256("".join(f"{f.file.path}\0{f.file.sha256}\0" for f in files).encode()).hexdigest()
        identity["files"] = len(files)
    if choice.categories is not None:
        identity["categories"] = sorted(choice.categories)
    about = {
        "given": [str(Path(p).resolve()) for p in paths],
        "files": [{"path": f.file.path, "sha256": f.file.sha256, "bytes": f.file.bytes, "read": f.file.conversations,
                   **({"sources": list(f.file.sources)} if f.file.sources else {}),
                   **({"excluded": excluded[k]} if choice.exclude is not None else {}), "kept": kept[k]}
                  for k, f in enumerate(files)],
        "categories": {c: {"kept": by_category[c]} for c in sorted(by_category)},
    }
    if choice.categories is not None:
        about["categories_chosen"] = sorted(choice.categories)
    if choice.exclude is not None:
        about["excluded_conversations"] = sum(excluded.values())
    user = UserText(prompts=tuple(turns for turns, _, _ in rows), categories=tuple(c for _, c, _ in rows),
                    origins=tuple(k for _, _, k in rows), files=tuple(f.file for f in files),
                    categorised=any(c is not None for f in files for c in f.categories), about=about)
    return user, identity


def load_user_text(prompts: str | Path | Sequence[str | Path] | None, passages: str | Path | None,
                   max_passage_tokens: int, min_passage_tokens: int, part: tuple[int, int] | None = None,
                   categories: Sequence[str] | None = None, exclude_questions: str | Path | None = None) -> UserText:
    """Read ``--prompts`` (files or directories) and ``--passages`` (either may be None), or the ``part`` (K, N) of
    them this process takes: the conversations of ``categories`` alone (None: all), none (and no passage) that
    overlaps a question of ``exclude_questions``.

    Passages are cut by characters, about four to a token, so that a large corpus needs no
    tokenising up front; the pasted text is cut to tokens later. The identity records the
    files' hashes, the part and what was left out, so a resumed run refuses other files or another part.
    """
    if part is not None and prompts is None and passages is None:
        raise MoaspecError("--part splits a --prompts or --passages file between processes; give one of them")
    if exclude_questions is not None and prompts is None and passages is None:
        raise MoaspecError("--exclude-questions leaves out --prompts and --passages that overlap questions; "
                           "give one of them")
    if categories is not None and prompts is None:
        raise MoaspecError("--categories chooses among the categories of --prompts; give it")
    identity: dict[str, Any] = {}
    exclude: QuestionOverlap | None = None
    if exclude_questions is not None:
        exclude, digest, count = read_questions(exclude_questions)
        identity["exclude_questions"] = {"sha256": digest, "questions": count}
    user = UserText()
    if prompts is not None:
        paths = [prompts] if isinstance(prompts, (str, Path)) else list(prompts)
        user, identity["prompts"] = load_prompts(paths, PromptChoice(
            None if categories is None else tuple(categories), exclude, part))
        if exclude_questions is not None:
            user.about["excluded_by"] = {"path": str(Path(exclude_questions).resolve()),
                                         **identity["exclude_questions"]}
    texts: tuple[str, ...] = ()
    if passages is not None:
        texts, digest = read_passages(Path(passages), 4 * max_passage_tokens, 4 * min_passage_tokens)
        if exclude is not None:
            kept = tuple(t for t in texts if not exclude.overlaps(t))
            if not kept:
                raise MoaspecError(f"every passage of {passages} overlaps a question of --exclude-questions")
            user.about["excluded_passages"] = len(texts) - len(kept)
            texts = kept
        texts = _take_part(texts, part, "passages", passages)
        identity["passages"] = {"sha256": digest, "passages": len(texts)}
    if part is not None:
        identity["part"] = list(part)
    return UserText(user.prompts, texts, tuple(identity.items()), user.categories, user.origins, user.files,
                    user.categorised, user.about)
