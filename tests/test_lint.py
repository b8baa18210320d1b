"""The repository passes its linter and the package its type checker (both configured in pyproject.toml),
so style slips, unused or shadowed names, and type hints that say something the code does not do are
caught by the test command rather than by a reader."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str:
    """The test extras' ``name`` beside this interpreter (else on PATH)."""
    local = Path(sys.executable).parent / name
    exe = str(local) if local.exists() else shutil.which(name)
    assert exe, f"{name} is missing: it comes with the test extras (pip install -e '.[test]')"
    return exe


def test_ruff_finds_nothing() -> None:
    run = subprocess.run([_tool("ruff"), "check", "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr


def test_mypy_finds_nothing(tmp_path: Path) -> None:
    run = subprocess.run([_tool("mypy"), "--cache-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
