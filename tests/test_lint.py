"""The repository passes its linter (configured in pyproject.toml), so style slips and unused or
shadowed names are caught by the test command rather than by a reader."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing() -> None:
    ruff = Path(sys.executable).parent / "ruff"
    exe = str(ruff) if ruff.exists() else shutil.which("ruff")
    assert exe, "ruff is missing: it comes with the test extras (pip install -e '.[test]')"
    run = subprocess.run([exe, "check", "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
