"""Reading SpecBench-format question files (for measuring only, never for training)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moaspec.errors import MoaspecError, PromptError


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str  # the file's stem (mt_bench, humaneval, ...), one per SpecBench task
    turns: tuple[str, ...]


def load_questions(path: str | Path, per_file: int | None = None, skip: int = 0) -> list[Question]:
    """All questions of a ``.jsonl`` file or of every ``.jsonl`` in a directory (sorted by name).

    ``per_file`` keeps the first K of each file, after leaving out its first ``skip`` (so that
    a second sample of the same size measures what the first did not). The category is the
    file name, as the ``category`` field of mt_bench holds sub-categories.
    """
    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not path.exists() or not files:
        raise MoaspecError(f"no SpecBench .jsonl question files at {path}")
    if per_file is not None and per_file < 1:
        raise MoaspecError(f"--limit must be >= 1 (questions per file), got {per_file}")
    if skip < 0:
        raise MoaspecError(f"cannot leave out a negative number of questions per file ({skip})")
    out: list[Question] = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError) as exc:
            raise MoaspecError(f"cannot read {f} as UTF-8 text: {exc}") from None
        rows: list[Question] = []
        seen: dict[str, int] = {}  # question id -> its line: answers and results are kept per id
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                turns = obj["turns"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise MoaspecError(f"{f}:{n} is not a SpecBench question (JSON with a 'turns' list)") from None
            if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
                got = type(turns).__name__ if not isinstance(turns, list) else "a list holding " + ", ".join(
                    sorted({type(t).__name__ for t in turns if not isinstance(t, str)}))
                raise MoaspecError(f"{f}:{n}: 'turns' must be a list of strings, got {got}")
            if not turns or not all(t.strip() for t in turns):
                raise MoaspecError(f"{f}:{n} has no turns, or an empty one")
            qid = str(obj.get("question_id", n))
            if qid in seen:
                raise MoaspecError(f"{f}:{n} repeats question_id {qid} of line {seen[qid]}; give each question its own")
            seen[qid] = n
            rows.append(Question(qid, f.stem, tuple(turns)))
        rows = rows[skip:]
        out.extend(rows[:per_file] if per_file else rows)
    if not out:
        raise MoaspecError(f"no questions in {path} (its .jsonl files are empty)")
    return out


def check_first_turns_fit(questions: list[Question], tokenizer: Any, context: int) -> None:
    """Refuse, before any measuring, a question whose first turn leaves no room to answer in ``context``.

    (A later turn that no longer fits ends its conversation there, as a chat would.)
    """
    from moaspec.chat import check_fits, encode_chat

    for q in questions:
        try:
            check_fits(len(encode_chat(tokenizer, [{"role": "user", "content": q.turns[0]}])), context)
        except PromptError as exc:
            raise MoaspecError(f"question {q.question_id} of {q.category}: {exc}") from None
