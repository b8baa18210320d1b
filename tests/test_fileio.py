"""Atomic writes: the file or directory appears whole or not at all, with the permissions of any new file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from moaspec.fileio import atomic_write, atomic_write_dir, atomic_write_text


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_written_files_and_directories_get_the_usual_permissions(tmp_path: Path) -> None:
    """mkstemp/mkdtemp make private files; a checkpoint or data shard must not stay readable by its owner only."""
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    os.mkdir(tmp_path / "plain-dir")
    atomic_write_text(tmp_path / "a.txt", "hello")
    atomic_write_dir(tmp_path / "d", lambda d: (d / "f").write_text("x"))
    assert (tmp_path / "a.txt").read_text() == "hello"
    assert mode(tmp_path / "a.txt") == mode(plain)
    assert mode(tmp_path / "d") == mode(tmp_path / "plain-dir")


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "ckpt.bin"
    atomic_write_text(target, "old")

    def fail(p: Path) -> None:
        p.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, fail)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.bin"]
