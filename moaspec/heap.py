"""Hand the memory a finished conversation freed back to the operating system.

A server allocates each conversation a KV cache sized to its prompt and budget, so the
sizes vary from one to the next and many are alive at once. glibc's malloc keeps what
they free in its arenas (its mmap threshold rises to the size of the largest block
freed, so later caches come from the heap, not from fresh mappings) and seldom returns
it: four threads opening sessions of random lengths on one session store grew its
process 1.66 → 3.99 GB in 300 sessions, and one ``malloc_trim(0)`` at the end brought it
back to 1.73 GB (docs/experiments/2026-11-21-client-server-reliability.md). Trimming
whenever a conversation ends keeps that bounded. A trim takes about 34 ms (median), so it runs on a
thread of its own, not on the request that ended the conversation; conversations that end
while it runs share the next one.

Elsewhere than glibc (macOS, musl) this does nothing: their allocators return memory
by other rules.

oneDNN's kernel caches grow with every new input shape too; :func:`cap_kernel_caches` bounds them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable


def _find_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # no C library by that name, or not glibc
        return None


_trim = _find_trim()
_wanted = threading.Event()
_worker: threading.Thread | None = None
_worker_lock = threading.Lock()


def trim_now() -> bool:
    """Return the allocator's free pages to the OS (``malloc_trim(0)``) now; False if the C library cannot."""
    if _trim is None:
        return False
    _trim(0)
    return True


def _trim_when_asked() -> None:
    while True:
        _wanted.wait()
        _wanted.clear()  # asks from here on get a trim of their own
        trim_now()


def release_free_memory() -> None:
    """Ask for a trim soon, on the trimming thread (started on first use); returns at once."""
    global _worker
    if _trim is None:
        return
    with _worker_lock:
        if _worker is None:
            _worker = threading.Thread(target=_trim_when_asked, name="moaspec-heap-trim", daemon=True)
            _worker.start()
    _wanted.set()


def cap_kernel_caches(entries: int = 64) -> None:
    """Bound oneDNN's two per-shape kernel caches, unless the environment already sets them.

    oneDNN caches a kernel per input shape (1024 by default) and PyTorch's wrapper of it (ideep) keeps a
    second cache of its own; decoding sees ever new shapes (prompt and cache lengths), so a long-running
    server's memory grew without bound, then with the first capped still about 2.5 MB per conversation.
    At 64 both stay flat and decoding is as fast (docs/experiments/2026-11-21-client-server-reliability.md).
    The caches read these variables when first used, so this must run before the first CPU forward.
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(entries))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(entries))
