"""A benchmark's server child ends when the benchmark is killed, rather than holding its port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

PARENT = """
import sys, time
from moaspec.childproc import child
p = child([sys.executable, "-c", "import time; time.sleep(120)"])
print(p.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for init to reap it is gone too
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_is_terminated_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    grandchild = int(parent.stdout.readline())  # type: ignore[union-attr]
    assert alive(grandchild)
    parent.send_signal(signal.SIGKILL)  # no finally, no atexit: only the kernel can end the child now
    parent.wait(10)
    deadline = time.monotonic() + 10
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild)
