"""A TCP proxy that makes a loopback link behave like a LAN, 4G or 5G link, or die.

This kernel has no netem, so the link is emulated in user space between real sockets:
each chunk written in one direction is delivered after the link is free (its size at
the profile's bandwidth) plus a one-way delay drawn from the profile's normal
distribution (clipped at 0), never before the chunk ahead of it (TCP is in order).
Packet loss is modelled as what TCP makes of it: with the loss probability per
1448-byte segment, the chunk waits one extra retransmission timeout. Draws come from
a seeded generator, so a profile replays the same way. ``cut()`` kills the link:
open connections are reset and new ones refused until ``restore()``.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass

SEGMENT = 1448  # bytes of payload per TCP segment on a 1500-byte MTU


@dataclass(frozen=True)
class Profile:
    name: str
    delay_ms: float  # mean one-way delay
    jitter_ms: float  # its standard deviation
    mbit_s: float  # bandwidth, each direction
    loss: float = 0.0  # per segment
    rto_ms: float = 200.0  # Linux's minimum retransmission timeout

    def describe(self) -> str:
        return (f"{self.name}: one-way {self.delay_ms:g} ± {self.jitter_ms:g} ms, {self.mbit_s:g} Mbit/s, "
                f"{self.loss * 100:g}% loss")


PROFILES = {
    "lan": Profile("lan", 4.5, 0.0, 50.0),
    "4g": Profile("4g", 21.0, 19.0, 20.0, loss=0.001),
    "5g": Profile("5g", 10.0, 10.0, 100.0, loss=0.001),
    "none": Profile("none", 0.0, 0.0, float("inf")),
}


def parse_profile(spec: str) -> tuple[Profile, int | None]:
    """``lan``, ``4g``, ``5g`` or ``none``, optionally ``+offline-after:K``; or ``offline-after:K`` alone (on ``lan``)."""
    cut = None
    parts = spec.split("+")
    base = PROFILES["lan"]
    for part in parts:
        if part.startswith("offline-after:"):
            try:
                cut = int(part.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"offline-after needs a token count, got {part!r}") from None
            if cut < 0:
                raise ValueError("offline-after needs a token count >= 0")
        elif part in PROFILES:
            base = PROFILES[part]
        else:
            raise ValueError(f"unknown network profile {part!r}; choose from {', '.join(PROFILES)} or offline-after:K")
    return base, cut


class NetworkProxy:
    """Forward ``127.0.0.1:port`` to ``upstream`` through an emulated link, on its own thread."""

    def __init__(self, upstream: tuple[str, int], profile: Profile, seed: int = 0) -> None:
        self.upstream, self.profile = upstream, profile
        self.rng = random.Random(seed)
        self.port = 0
        self._down = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="netem")

    def start(self) -> NetworkProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("network proxy did not start")
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def _delay(self, nbytes: int) -> float:
        p = self.profile
        d = max(0.0, self.rng.gauss(p.delay_ms, p.jitter_ms)) / 1000 if p.jitter_ms else p.delay_ms / 1000
        segments = max(1, -(-nbytes // SEGMENT))
        if p.loss and any(self.rng.random() < p.loss for _ in range(segments)):
            d += p.rto_ms / 1000
        return d

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        p = self.profile
        free_at = last = 0.0
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                at, data = item
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while data := await reader.read(65536):
                now = time.monotonic()
                free_at = max(free_at, now) + (len(data) * 8 / (p.mbit_s * 1e6) if p.mbit_s != float("inf") else 0.0)
                last = max(last, free_at + self._delay(len(data)))
                queue.put_nowait((last, data))
            queue.put_nowait(None)
            await sender
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            pass
        finally:
            sender.cancel()

    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        if self._down:
            self._reset(cwriter)
            return
        try:
            sreader, swriter = await asyncio.open_connection(*self.upstream)
        except OSError:
            self._reset(cwriter)
            return
        self._writers |= {cwriter, swriter}
        try:
            await asyncio.gather(self._pipe(creader, swriter), self._pipe(sreader, cwriter))
        except asyncio.CancelledError:
            pass  # the proxy is stopping (returning normally spares asyncio a spurious traceback)
        finally:
            for w in (cwriter, swriter):
                self._writers.discard(w)
                w.close()

    @staticmethod
    def _reset(writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:  # RST instead of FIN: the peer sees the link fail, not a polite close
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()

    def cut(self) -> None:
        """The link dies: reset open connections, refuse new ones."""
        def kill() -> None:
            self._down = True
            for w in list(self._writers):
                self._reset(w)
        self._loop.call_soon_threadsafe(kill)

    def restore(self) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "_down", False)

    def stop(self) -> None:
        async def shut() -> None:
            self._server.close()
            for w in list(self._writers):
                self._reset(w)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
