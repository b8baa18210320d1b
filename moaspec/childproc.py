"""Child processes that end with the process that started them.

A benchmark starts ``moaspec serve`` as a child. Killed by a signal (``kill``, a session's end), the benchmark
runs no ``finally``, and an orphaned server would go on holding its port and a core, so that the next run finds
"address already in use" and its timings share the machine. On Linux the kernel can send the child a signal when
its parent dies (``PR_SET_PDEATHSIG``); elsewhere the child is stopped only by the parent's own cleanup.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _terminate_with_parent() -> None:
    """Runs in the child between fork and exec: SIGTERM it when the parent (the forking thread) exits."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def child(cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kwargs)``, terminated when this process dies, however it dies (on Linux)."""
    return subprocess.Popen(list(cmd), preexec_fn=_terminate_with_parent if sys.platform == "linux" else None,
                            **kwargs)
