"""Run a moaspec app on a real socket in a background thread, for end-to-end tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from moaspec.serving import listen
from moaspec.serving.app import server_config


@contextmanager
def running(app, **timeouts: float) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """Serve ``app`` on a free loopback port, with the server's own settings (``timeouts``: its header and idle
    timeouts, shortened); yield its base URL; stop it afterwards."""
    sock = listen("127.0.0.1", 0)
    config = server_config(app, log_level="warning", **timeouts)
    config.timeout_graceful_shutdown = 2
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
