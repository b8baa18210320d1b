"""Reading SpecBench-format question files (for measuring only, never for training)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moaspec.errors import MoaspecError


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str  # the file's stem (mt_bench, humaneval, ...), one per SpecBench task
    turns: tuple[str, ...]


def load_questions(path: str | Path, per_file: int | None = None) -> list[Question]:
    """All questions of a ``.jsonl`` file or of every ``.jsonl`` in a directory (sorted by name).

    ``per_file`` keeps the first K of each file. The category is the file name, as the
    ``category`` field of mt_bench holds sub-categories.
    """
    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not path.exists() or not files:
        raise MoaspecError(f"no SpecBench .jsonl question files at {path}")
    out: list[Question] = []
    for f in files:
        rows = []
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                turns = tuple(obj["turns"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise MoaspecError(f"{f}:{n} is not a SpecBench question (JSON with a 'turns' list)") from None
            if not turns or not all(isinstance(t, str) for t in turns):
                raise MoaspecError(f"{f}:{n} has no turns")
            rows.append(Question(str(obj.get("question_id", n)), f.stem, turns))
        out.extend(rows[:per_file] if per_file else rows)
    return out
