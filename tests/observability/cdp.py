"""A real headless Chromium driven over the DevTools protocol (websockets), for the dashboard's browser tests.

Owns starting Chromium (Debian's `chromium` package; `make system-deps` installs it), one page
session, and collecting console errors; a missing Chromium raises, so the tests fail, never skip.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

from tests.support.procs import ProcessGroup, wait_until

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium_binary() -> str:
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError("no Chromium found (looked for chromium, chromium-browser, google-chrome); "
                       "`make system-deps` installs Debian's chromium package")


class Browser:
    """One headless Chromium process (started through `procs`, so stopped by PID) and one page."""

    def __init__(self, procs: ProcessGroup, profile: Path, width: int = 1400, height: int = 900,
                 extra_args: tuple[str, ...] = ()) -> None:
        profile.mkdir(parents=True, exist_ok=True)
        port_file = profile / "DevToolsActivePort"
        port_file.unlink(missing_ok=True)  # a reused profile keeps the last run's port
        self.proc = procs.start([chromium_binary(), "--headless=new", "--no-sandbox", "--disable-gpu",
                                 "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
                                 "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                                 f"--user-data-dir={profile}", f"--window-size={width},{height}", *extra_args,
                                 "about:blank"],
                                name="chromium")
        port = wait_until(lambda: port_file.exists() and port_file.read_text().split("\n")[0].strip(), 30.0,
                          0.1, "Chromium's DevTools port")
        pages = wait_until(lambda: [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=2).json()
                                    if t["type"] == "page"], 15.0, 0.1, "a Chromium page target")
        self._exit = contextlib.ExitStack()
        self.ws: ClientConnection = self._exit.enter_context(connect(pages[0]["webSocketDebuggerUrl"],
                                                                     max_size=64 * 2**20))
        self._ids = itertools.count(1)
        self.console_errors: list[str] = []
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")

    def close(self) -> None:
        self._exit.close()
        self.proc.stop()

    # --- protocol ----------------------------------------------------------------------------
    def call(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(deadline - time.monotonic(), 0.01)))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self._event(msg)

    def _event(self, msg: dict[str, Any]) -> None:
        method, params = msg.get("method"), msg.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.console_errors.append(f"uncaught: {details.get('exception', {}).get('description') or details}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.console_errors.append("console.error: " + " ".join(str(a.get("value", a.get("description")))
                                                                    for a in params.get("args", [])))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            entry = params["entry"]
            self.console_errors.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}")

    def pump(self) -> None:
        """Take in the events that arrived (console messages) without sending anything."""
        while True:
            try:
                self._event(json.loads(self.ws.recv(timeout=0.01)))
            except TimeoutError:
                return

    # --- page --------------------------------------------------------------------------------
    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        wait_until(lambda: self.evaluate("document.readyState") == "complete", 30.0, 0.1, f"{url} to load")

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path
