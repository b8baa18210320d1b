"""Freed heap memory goes back to the OS when a conversation ends (moaspec/heap.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moaspec import heap

# In a fresh interpreter: 250 MB in 64 KB blocks (below glibc's mmap threshold, so from the heap), all freed but the
# last, which keeps glibc from trimming the top of the heap on its own; RSS in MB before and after the release.
PROBE = """
import ctypes, re
from pathlib import Path
from moaspec.heap import trim_now
def rss(): return int(re.search(r"VmRSS:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)) // 1024
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
blocks = [libc.malloc(64 * 1024) for _ in range(4000)]
for b in blocks:
    ctypes.memset(b, 1, 64 * 1024)
for b in blocks[:-1]:
    libc.free(b)
before = rss()
assert trim_now()
print(before, rss())
"""


@pytest.mark.skipif(heap._trim is None or not sys.platform.startswith("linux"), reason="glibc's malloc_trim only")
def test_release_returns_freed_heap_pages() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    before, after = map(int, out.stdout.split())
    assert before - after > 200, (before, after)  # freed but held by malloc, then given back


def test_release_returns_at_once_and_the_trimming_thread_trims(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import threading

    trimmed = threading.Event()
    monkeypatch.setattr(heap, "_trim", lambda pad: trimmed.set() or 1)
    heap.release_free_memory()
    assert trimmed.wait(10)


def test_sessions_release_memory_when_they_end(tiny_llama, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from moaspec.clientserver import sessions

    calls: list[int] = []
    monkeypatch.setattr(sessions, "release_free_memory", lambda: calls.append(1))
    store = sessions.SessionStore(tiny_llama, None, sessions.Limits())
    store.close(store.open([1, 2, 3], "none")["session"])
    assert calls == [1]
    for sid in [store.open(prompt, "none")["session"] for prompt in ([1, 2, 3], [4, 5])]:
        store._sessions[sid].expires = 0.0  # due long ago
    store.open([6], "none")  # finds the two expired, frees them and releases once
    assert calls == [1, 1] and store.info()["open_sessions"] == 1


def test_a_served_request_releases_memory_when_it_ends(tiny_llama, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import asyncio
    import time

    from moaspec.decoding import GenerationConfig
    from moaspec.decoding.generation import GenerationResult
    from moaspec.serving import engine as engine_module
    from moaspec.strategy import Strategy

    calls: list[int] = []
    monkeypatch.setattr(engine_module, "release_free_memory", lambda: calls.append(1))
    engine = engine_module.Engine(tiny_llama, Strategy(), parallel=1)

    async def answer() -> list[object]:
        return [item async for item in engine.stream([1, 2, 3], GenerationConfig(max_new_tokens=4))]

    try:
        items = asyncio.run(answer())
        assert isinstance(items[-1], GenerationResult)
        deadline = time.monotonic() + 10  # the worker releases after handing over its result
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls == [1]
    finally:
        engine.close()
