"""Noticing a client that has gone while its request still waits for the server.

Starlette cancels a streaming response whose client disconnects, but not a handler that is
still awaiting its answer (a long prompt's prefill: 23 s for 7,800 tokens on a 2-core CPU).
Without a watch, that work runs to the end for nobody, holding a decoding slot, and a client
that timed out and retried makes the server do it twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from moaspec.serving.errors import APIError

T = TypeVar("T")

POLL_S = 0.5


async def unless_disconnected(awaitable: Awaitable[T], request: Request) -> T:
    """Await ``awaitable``; if the client disconnects first, cancel it and answer 499.

    Cancelling stops what is awaited at its next await; work on a thread must also be told
    (the callers' own events) to stop between chunks.
    """
    task = asyncio.ensure_future(awaitable)
    while not task.done():
        await asyncio.wait([task], timeout=POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            # a worker thread can still end the task with its own error later: retrieved, so not logged as lost
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            raise APIError(499, "the client closed the connection")
    return task.result()
