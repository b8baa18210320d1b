"""`moaspec serve` started as its own process for a benchmark, and stopped when the benchmark ends.

Not run on its own; it is imported by the serving scripts beside it, for example:

    .venv/bin/python benchmarks/serve_load.py --clients 8 --seconds 180 --max-tokens 128 --output bench-out/serve-load.json
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx

from moaspec.childproc import child


@contextmanager
def serving(port: int, serve_args: Sequence[str] = (), core: int | None = None) -> Iterator[subprocess.Popen]:
    """Start the server on ``port`` (pinned to ``core``, if given) and yield its process once it listens (it prints
    "serving ... on URL")."""
    cmd = [sys.executable, "-m", "moaspec.cli", "serve", "--port", str(port), "--log-level", "warning", *serve_args]
    cmd = cmd if core is None else ["taskset", "-c", str(core), *cmd]
    server = child(cmd, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stderr.readline()  # type: ignore[union-attr]
        if "serving" not in line:
            sys.exit(f"server did not start: {line}{server.stderr.read()}")  # type: ignore[union-attr]
        print(line.strip(), file=sys.stderr)
        yield server
    finally:
        server.terminate()
        server.wait(30)


def sse_chunks(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON chunks of a streamed OpenAI API response (its ``data: {...}`` lines), as they arrive."""
    for line in response.iter_lines():
        if line.startswith("data: {"):
            yield json.loads(line[6:])
