"""A headless Chromium driven over the DevTools protocol, for testing the chat page as users see it."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

from websockets.sync.client import connect


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if path := shutil.which(name):
            return path
    return None


class Browser:
    """One headless browser page: navigate, evaluate JavaScript, take screenshots."""

    def __init__(self, width: int = 1100, height: int = 800) -> None:
        path = chromium_path()
        if path is None:
            raise RuntimeError("no Chromium found")
        # a straggling helper process may still write into the profile as it is removed: never fail a test for that
        self.profile = tempfile.TemporaryDirectory(ignore_cleanup_errors=True)
        self.proc = subprocess.Popen(
            [path, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--remote-debugging-port=0", f"--user-data-dir={self.profile.name}", f"--window-size={width},{height}",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        devtools = None
        for line in self.proc.stderr:  # type: ignore[union-attr]
            if m := re.search(r"DevTools listening on (ws://\S+)", line):
                devtools = m.group(1)
                break
        if devtools is None:
            raise RuntimeError("Chromium did not start its DevTools endpoint")
        http = devtools.split("/devtools/")[0].replace("ws://", "http://")
        pages = json.load(urllib.request.urlopen(http + "/json/list", timeout=10))
        page = next(p for p in pages if p["type"] == "page")
        self._stack = ExitStack()
        self.ws = self._stack.enter_context(connect(page["webSocketDebuggerUrl"], max_size=64 << 20))
        self._id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def goto(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float) -> Any:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if value := self.evaluate(expression):
                return value
            time.sleep(0.2)
        raise TimeoutError(f"{expression} stayed false for {timeout} s")

    def screenshot(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        """Stop Chromium with all its helper processes (its own process group), then remove the profile.

        Terminating only the main process left renderer or utility processes writing into the
        profile while it was removed ("Directory not empty", once in CI).
        """
        self._stack.close()
        with suppress(ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever outlived the main process
        self.proc.wait(10)
        self.profile.cleanup()
