"""Atomic file writes: a reader (or a resumed run) never sees a half-written file."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from moaspec.errors import MoaspecError


def _umask() -> int:
    """The process's umask (reading it means setting it; it is set straight back)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp_path)`` on a temporary file beside ``path``, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        # mkstemp makes it private, and so does a writer that creates the file anew (safetensors' save_file):
        # the result should look like any other new file (a drafter or data set others may read)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def atomic_write_dir(path: str | Path, write: Callable[[Path], None], marker: str) -> None:
    """Call ``write(tmp_dir)`` on a fresh directory beside ``path``, then rename it into place.

    The directory appears complete or not at all. An older one at ``path`` is replaced
    only if it is empty or an earlier result of the same kind (it holds ``marker``, a
    file that ``write`` always writes): an ``--output`` that names a folder of the
    user's own files, or a file, is refused rather than deleted.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise MoaspecError(f"{path} is a file; name a new directory (or an earlier one of these) instead")
    if path.is_dir() and any(path.iterdir()) and not (path / marker).is_file():
        raise MoaspecError(f"{path} holds other files (it has no {marker}); name a new or empty directory, "
                           "or an earlier one of these to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the result should look like any other directory
    try:
        write(tmp)
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_output_dir(path: str | Path, marker: str | None = None, own: tuple[str, ...] = ()) -> None:
    """Refuse an ``--output`` directory before any work: one that cannot be created or written, and, given
    ``marker``, an existing one that holds files the command would not write.

    ``marker`` is the file that makes the directory an earlier run the command resumes;
    ``own`` are glob patterns of what such a run writes before it (names starting with a dot,
    the atomic writes' temporary files, always count as its own). Nothing is left behind: the
    check creates a temporary directory where ``path`` would go and removes it.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise MoaspecError(f"--output {path} is a file; it must name a directory (new, or one this command wrote)")
    parent = path
    while not parent.exists():  # the nearest existing folder, where the missing ones would be created
        parent = parent.parent
    if not parent.is_dir():
        raise MoaspecError(f"cannot create --output {path}: {parent} is a file")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".moaspec-probe.", dir=parent))
    except OSError as exc:
        raise MoaspecError(f"cannot create --output {path}: {exc.strerror or exc} ({parent})") from None
    if marker is None or not path.is_dir() or (path / marker).is_file():
        return
    foreign = sorted(p.name for p in path.iterdir()
                     if not p.name.startswith(".") and not any(p.match(pattern) for pattern in own))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise MoaspecError(f"--output {path} holds files this command did not write ({shown}); "
                           "name a new or empty directory, or one this command wrote to resume it")
