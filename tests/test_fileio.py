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
    atomic_write_dir(tmp_path / "d", lambda d: (d / "f").write_text("x"), marker="f")
    assert (tmp_path / "a.txt").read_text() == "hello"
    assert mode(tmp_path / "a.txt") == mode(plain)
    assert mode(tmp_path / "d") == mode(tmp_path / "plain-dir")
    # safetensors' save_file creates its file private itself (exported drafters were 0600 beside 0644 configs)
    import torch
    from safetensors.torch import save_file

    atomic_write(tmp_path / "w.safetensors", lambda p: save_file({"w": torch.zeros(2)}, str(p)))
    assert mode(tmp_path / "w.safetensors") == mode(plain)


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


def test_a_directory_write_replaces_only_an_earlier_result_or_an_empty_directory(tmp_path: Path) -> None:
    """``--output`` naming a folder of the user's own files, or a file, is refused, never deleted."""
    from moaspec.errors import MoaspecError

    def write(d: Path) -> None:
        (d / "config.json").write_text("{}")

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    plain = tmp_path / "plain.txt"
    plain.write_text("keep me too")
    for path, message in ((mine, "holds other files"), (plain, "is a file")):
        with pytest.raises(MoaspecError, match=message):
            atomic_write_dir(path, write, marker="config.json")
    assert (mine / "notes.txt").read_text() == "keep me" and plain.read_text() == "keep me too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "plain.txt"]  # no temporary left behind
    (tmp_path / "empty").mkdir()
    atomic_write_dir(tmp_path / "empty", write, marker="config.json")
    (tmp_path / "empty" / "config.json").write_text('{"old": 1}')
    atomic_write_dir(tmp_path / "empty", write, marker="config.json")  # an earlier result is replaced
    assert (tmp_path / "empty" / "config.json").read_text() == "{}"
