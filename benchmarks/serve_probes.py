"""Hostile and careless requests replayed against a live `moaspec serve`: what each gets back, and how long
`/health` waited while it ran.

Starts the server as `--parallel 2 --max-queue 2` with an API key and a short `--session-ttl`, then runs
each probe in turn while a thread asks `/health` without pause; a probe that holds up the event loop
shows as a long worst `/health` latency. Bodies are encoded before a probe's window opens, so the
client's own work is not counted. Every probe is bounded (a timeout, or a fixed count).

    .venv/bin/python benchmarks/serve_probes.py --output bench-out/serve-probes.json

Targets: no 500; no probe holds `/health` up for over 100 ms; a queued client that leaves frees its
place within 1 s; an idle client–server session is freed within one TTL; nothing but `/` and `/health`
answers without the key.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from served import serving

KEY = "sk-probe"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
BODY_LIMIT = 1 << 20  # the server's default --max-body-bytes
LONG = "Write a long, detailed story about a lighthouse keeper and a storm."
COUNTING = "Counting from 1 to 1000: 1, 2, 3, 4, 5,"  # a completion that runs to max_tokens


class HealthWatch:
    """Asks ``/health`` back to back on its own connection and keeps each answer's latency."""

    def __init__(self, base: str) -> None:
        self.base, self.samples, self._stop = base, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=60) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                c.get("/health").raise_for_status()
                self.samples.append((t0, time.perf_counter() - t0))
                time.sleep(0.005)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(60)

    @contextmanager
    def window(self) -> Iterator[list[float]]:
        """Yield a list that, on leaving, holds the worst latency of the requests begun or answered meanwhile."""
        began, worst = time.perf_counter(), []
        yield worst
        time.sleep(0.05)  # let a /health request held up by the probe's end come back
        ended = time.perf_counter()
        worst.append(max((lat for t0, lat in self.samples if t0 <= ended and t0 + lat >= began), default=float("nan")))


def raw_post(base: str, path: str, body: bytes) -> socket.socket:
    """A request sent whole on a socket of its own, whose answer is not read (a client that may leave)."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    sock.sendall(head.encode() + body)
    return sock


def compact(obj: object) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > BODY_LIMIT:
        raise ValueError(f"a probe body of {len(data)} bytes is over the server's limit")
    return data


def until(check: Callable[[], bool], limit: float) -> float | None:
    """Seconds until ``check()`` holds (polled every 10 ms), or None after ``limit`` s."""
    began = time.perf_counter()
    while time.perf_counter() - began < limit:
        if check():
            return time.perf_counter() - began
        time.sleep(0.01)
    return None


class Probes:
    """Each probe returns what it saw, in a few words; the table adds the worst /health latency."""

    def __init__(self, base: str, model: str, ttl: float, server_pid: int) -> None:
        self.base, self.model, self.ttl, self.pid = base, model, ttl, server_pid
        self.http = httpx.Client(base_url=base, headers=AUTH, timeout=120)

    def _status(self, path: str, body: bytes) -> str:
        r = self.http.post(path, content=body)
        return f"{r.status_code}, {len(r.content)} B"

    def bodies(self) -> dict[str, tuple[str, bytes]]:
        """The one-request probes' bodies, encoded before any window opens."""
        m, digits = self.model, "9" * 5000
        fit = (BODY_LIMIT - 200) // len('{"role":"user","content":"x"},')
        return {
            "262,128 one-character prompts": ("/v1/completions", compact({"model": m, "prompt": ["x"] * 262_128,
                                                                          "max_tokens": 1})),
            "262,128 one-id prompts": ("/v1/completions", compact({"model": m, "prompt": [[1]] * 262_128,
                                                                   "max_tokens": 1})),
            f"chat of {fit:,} messages": ("/v1/chat/completions", compact(
                {"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}] * fit})),
            "16 stop strings of 65,000 characters": ("/v1/completions", compact(
                {"model": m, "prompt": LONG, "max_tokens": 8, "stop": ["x" * 65_000] * 16})),
            "logit_bias key of 5,000 digits": ("/v1/completions", compact(
                {"model": m, "prompt": "hi", "max_tokens": 1, "logit_bias": {digits: 1.0}})),
            "client–server open, logit_bias key of 5,000 digits": ("/cs/v1/sessions", compact(
                {"prompt": [1, 2], "state": "none", "sampling": {"logit_bias": {digits: 1.0}}})),
            'model "\\ud800"': ("/v1/completions", b'{"model":"\\ud800","prompt":"hi","max_tokens":1}'),
            "prompt token id of 4,000 digits": ("/v1/completions", b'{"model":"%s","prompt":[%s],"max_tokens":1}'
                                                % (m.encode(), b"9" * 4000)),
        }

    def stop_cost(self) -> str:
        """16 stop strings of the largest length allowed against none: the answer's time, same greedy text."""
        times = []
        for stop in ([], ["\u2603" * 1000] * 16):
            t0 = time.perf_counter()
            r = self.http.post("/v1/completions", json={"model": self.model, "prompt": COUNTING, "max_tokens": 300,
                                                        "temperature": 0, **({"stop": stop} if stop else {})})
            times.append(time.perf_counter() - t0)
            tokens = r.json()["usage"]["completion_tokens"]
        return f"200, {tokens} tokens, {times[1]:.2f} s against {times[0]:.2f} s without ({times[1] / times[0]:.2f}×)"

    def queue_leavers(self) -> str:
        """Two long streams run, two more wait; the waiting ones' sockets close: how soon are their places free?"""
        chat = compact({"model": self.model, "stream": True, "max_tokens": 2000, "temperature": 0,
                        "messages": [{"role": "user", "content": LONG}]})
        load = lambda: self.http.get("/health").json()  # noqa: E731
        running = [raw_post(self.base, "/v1/chat/completions", chat) for _ in range(2)]
        try:
            if until(lambda: load()["running"] == 2, 30) is None:
                return "the long requests did not start"
            queued = [raw_post(self.base, "/v1/chat/completions", chat) for _ in range(2)]
            if until(lambda: load()["waiting"] == 2, 10) is None:
                return "the queued requests were not seen waiting"
            for sock in queued:
                sock.close()
            freed = until(lambda: load()["waiting"] == 0, 10)
            if freed is None:
                return "waiting 2 → still waiting after 10 s"
            return f"waiting 2 → 0 {freed:.2f} s after they left"
        finally:
            for sock in running:
                sock.close()
            until(lambda: load()["running"] == 0, 30)

    def half_headers(self, count: int = 200, limit: float = 15.0) -> str:
        """``count`` connections that send half a request's headers and stop: how many does the server close?"""
        host, port = self.base.removeprefix("http://").split(":")
        socks = []
        for _ in range(count):
            sock = socket.create_connection((host, int(port)))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
            sock.setblocking(False)
            socks.append(sock)
        began, closed = time.perf_counter(), {}
        while len(closed) < count and time.perf_counter() - began < limit:
            for i, sock in enumerate(socks):
                if i in closed:
                    continue
                try:
                    if sock.recv(4096) == b"":
                        closed[i] = time.perf_counter() - began
                except BlockingIOError:
                    pass
                except OSError:
                    closed[i] = time.perf_counter() - began
            time.sleep(0.05)
        for sock in socks:
            sock.close()
        latest = f", the last after {max(closed.values()):.1f} s" if closed else ""
        return f"{len(closed)}/{count} closed within {limit:.0f} s{latest}"

    def open_routes(self) -> str:
        """Every route asked without the key: those that answer anything but 401."""
        paths = ["/docs", "/openapi.json", "/docs/oauth2-redirect", "/redoc", "/v1/models", "/cs/v1/info", "/nope"]
        with httpx.Client(base_url=self.base, timeout=30) as bare:
            seen = {p: bare.get(p).status_code for p in [*paths, "/", "/health"]}
            seen["POST /v1/completions"] = bare.post("/v1/completions", json={}).status_code
        opened = sorted(p for p, status in seen.items() if status != 401)
        return f"{sum(s == 401 for s in seen.values())} × 401; open: {', '.join(opened)}"

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def idle_sessions(self) -> str:
        """Three sessions opened and left idle, with no other session request: how soon are they gone?"""
        before = self.rss_mb()
        for _ in range(3):
            self.http.post("/cs/v1/sessions", json={"prompt": [1, 2], "state": "none"}).raise_for_status()
        held = self.rss_mb()
        # counting them expires nothing (the server's timer does), so polling the count changes nothing
        gone = until(lambda: self.http.get("/cs/v1/info").json()["open_sessions"] == 0, 3 * self.ttl)
        took = "still held after 3 TTLs" if gone is None else f"all gone {gone:.2f} s after the last open"
        return f"3 opened (server RSS {before:.0f} → {held:.0f} MB), {took} (TTL {self.ttl:g} s)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8767)
    ap.add_argument("--session-ttl", type=float, default=4.0)
    ap.add_argument("--serve-args", default="", help="more arguments for the server")
    ap.add_argument("--output", default=None, help="write the table as JSON here")
    args = ap.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    serve = ["--parallel", "2", "--max-queue", "2", "--api-key", KEY, "--session-ttl", str(args.session_ttl),
             *args.serve_args.split()]
    rows: list[dict[str, object]] = []
    with serving(args.port, serve) as server, HealthWatch(base) as watch:
        probes = Probes(base, "", args.session_ttl, server.pid)
        probes.model = probes.http.get("/v1/models").json()["data"][0]["id"]
        runs: list[tuple[str, Callable[[], str]]] = [("nothing (the floor)", lambda: time.sleep(2) or "–")]
        runs += [(name, lambda p=path, b=body: probes._status(p, b)) for name, (path, body) in probes.bodies().items()]
        runs += [("16 stop strings of 1,000 characters, 300 tokens", probes.stop_cost),
                 ("2 queued clients leave", probes.queue_leavers),
                 ("200 half-sent headers", probes.half_headers),
                 ("every route without the key", probes.open_routes),
                 ("3 idle client–server sessions", probes.idle_sessions)]
        for name, run in runs:
            with watch.window() as worst:
                seen = run()
            rows.append({"probe": name, "seen": seen, "worst_health_ms": round(worst[0] * 1000, 1)})
            print(f"{name:<52} {worst[0] * 1000:8.1f} ms  {seen}", flush=True)
    width = max(len(str(r["probe"])) for r in rows)
    print(f"\n| {'probe':<{width}} | what it got | worst /health |\n| --- | --- | ---: |")
    for r in rows:
        print(f"| {r['probe']:<{width}} | {r['seen']} | {r['worst_health_ms']} ms |")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"serve_args": serve, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
