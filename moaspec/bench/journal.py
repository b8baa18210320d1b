"""A benchmark's finished pieces on disk, one line each, so that an interrupted run resumes.

A SpecBench run takes an hour on a CPU and a session can be cut off without warning:
``moaspec bench`` and ``moaspec bench-cs`` write each finished piece (a question's
answers by every method, a disconnection study of one prompt) to
``DIR/<name>.partial.jsonl`` as soon as it exists, fsynced, and the same command run
again does only what is missing. The first line records the run's settings; a journal
of other settings is set aside rather than mixed in, and a last line torn by the
interruption is ignored. The finished run removes the journal.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from moaspec.fileio import atomic_write_text


class Journal:
    """The pieces an earlier, interrupted run of the same settings finished (``done``), and new ones as they finish."""

    def __init__(self, path: Path, run: dict[str, Any], command: str, pieces: str) -> None:
        """``pieces``: what the run is made of, for the resuming message (e.g. "120 questions")."""
        self.path = path
        # as it reads back from the file: tuples become lists, paths and other objects strings
        self.run = json.loads(json.dumps(run, default=str))
        self.done = self._read(command)
        if self.done:
            print(f"{command}: resuming; {len(self.done)} of {pieces} already done in {path}", file=sys.stderr)
        else:
            atomic_write_text(path, json.dumps({"run": self.run}) + "\n")

    def _read(self, command: str) -> dict[str, Any]:
        if not self.path.exists():
            return {}
        lines = self.path.read_text(encoding="utf-8").splitlines()
        try:
            header = json.loads(lines[0]) if lines else None
        except json.JSONDecodeError:
            header = None
        if header != {"run": self.run}:
            print(f"{command}: {self.path} is from a run with other settings; starting afresh", file=sys.stderr)
            return {}
        done: dict[str, Any] = {}
        for line in lines[1:]:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                break  # torn by the interruption: that piece is done again
            if not isinstance(entry, dict) or entry.keys() != {"key", "value"}:
                break  # not a line this class wrote (an older format): done again too
            done[entry["key"]] = entry["value"]
        return done

    def record(self, key: str, value: Any) -> Any:
        """Append a finished piece (durably, before returning it)."""
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, "value": value}, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done[key] = value
        return value

    def finish(self) -> None:
        """The run's results are written: the journal has served."""
        self.path.unlink(missing_ok=True)
