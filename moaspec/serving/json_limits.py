"""A bound on how many JSON arrays and objects a request body may hold, checked on its bytes before it is parsed.

A 1 MiB body holds 262,144 one-element arrays (``[1],[1],...``). Parsing them into Python lists and
validating them took 1.5 s on the event loop (the garbage collector walks the new containers again and
again), and neither ``json`` nor pydantic lets go of the GIL meanwhile, so a worker thread would stall
the loop just the same: every other client and ``/health`` waited. No request needs that many: a batch
holds at most the server's capacity of prompts, and a chat's messages each take tokens of the context
window. Strings, numbers and ``true`` cost the parser little, so only containers are counted.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from moaspec.serving.errors import APIError

MAX_CONTAINERS = 16_384  # arrays and objects in one request body


def containers(body: bytes) -> int:
    """How many arrays and objects ``body`` opens, brackets inside strings not counted (exactly, where
    ``body`` is valid JSON; invalid JSON is refused either way).

    Counting every bracket is a bound from above that costs a millisecond per MiB; only a body over the
    limit by that count has its strings cut out first (a prompt of code or JSON holds many brackets):
    escaped backslashes, then escaped quotes are dropped, so that every quote left opens or closes a
    string, and the text between the quotes' pairs is what lies outside strings.
    """
    rough = body.count(b"[") + body.count(b"{")
    if rough <= MAX_CONTAINERS:
        return rough
    outside = b"".join(body.replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')[0::2])
    return outside.count(b"[") + outside.count(b"{")


class BoundedRoute(APIRoute):
    """A route whose JSON body is refused with a 400, unparsed, when it holds over ``MAX_CONTAINERS`` arrays
    and objects (FastAPI then reads the body it has already received)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def bounded(request: Request) -> Response:
            found = containers(await request.body())
            if found > MAX_CONTAINERS:
                raise APIError(400, f"the request body holds {found:,} JSON arrays and objects; this server reads at "
                                    f"most {MAX_CONTAINERS:,} in one request (send fewer prompts or messages)")
            return await handler(request)

        return bounded
