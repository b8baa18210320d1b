"""Sharing a CPU server's cores between its requests, and giving all of them to a prefill that runs alone.

`moaspec serve` gives each of its ``--parallel`` decoders a share of the cores: decoders that
each used every core would oversubscribe them when they run together (8 clients: 49.3 tok/s
with one thread per decoder against 46.2 with two each on 2 cores), and a decoding step
hardly gains from more threads anyway (27.5 against 27.7 tok/s alone). Reading a long prompt
does gain: 1,500 tokens took 3.6 s on one thread and 2.1 s on two. So a prefill that finds
no other work running takes every core, and asks again after each chunk: it goes back to
its share as soon as another request starts, and when its prompt is read.

Torch's thread count is per thread here (each worker sets its own); a thread created later
starts from the count last set anywhere, which is why every piece of work sets its share
when it begins (:meth:`Cores.busy`) instead of trusting what its thread had.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch


def usable_cores() -> int:
    """The cores this process may run on (taskset), not the machine's; macOS has no affinity to ask."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Cores:
    """``total`` cores for the whole server, ``share`` threads for each piece of work while others run."""

    def __init__(self, total: int, share: int) -> None:
        self.total, self.share = total, share
        self._busy = 0
        self._lock = threading.Lock()

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Count the work inside (a generation, a session's prefill or verification), on its share of threads."""
        torch.set_num_threads(self.share)
        with self._lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1

    def for_prefill(self, waiting: int = 0) -> int:
        """Threads for a prefill's next chunk (or a batch of forwards): every core if nothing else is busy, else the
        share. ``waiting``: work counted busy that only waits for this one (verifications whose forwards it runs)."""
        with self._lock:
            return self.total if self._busy <= 1 + waiting else self.share


def working(cores: Cores | None) -> AbstractContextManager[None]:
    """:meth:`Cores.busy` for a server that shares its cores; nothing otherwise (the process's threads as they are)."""
    return cores.busy() if cores is not None else nullcontext()


def prefill_threads(cores: Cores | None) -> Callable[[], int] | None:
    """What a :class:`~moaspec.decoding.prefill.Prefill` asks for its threads (None: it keeps its thread's)."""
    return cores.for_prefill if cores is not None else None
