"""Process and waiting helpers shared by tests that start real processes.

Every process a test starts goes through `ProcessGroup.start`, which records its PID
and stops it (its whole process group) when the test ends, pass or fail.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx

REPO = Path(__file__).resolve().parents[2]
KVROUTE = [sys.executable, "-m", "proxy.cli"]
T = TypeVar("T")


# Ports for the processes tests start come from below the kernel's ephemeral range
# (ip_local_port_range, 32768-60999 by default), one block per xdist worker. A port
# from bind(("127.0.0.1", 0)) is ephemeral: between the check and the child's own bind,
# any outgoing connection (a proxy's upstream client, the other xdist worker's test)
# could take it, and the child then fails with EADDRINUSE.
_PORT_FLOOR = 20000
_PORTS_PER_XDIST_WORKER = 3000


def _port_candidates() -> Iterator[int]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = _PORT_FLOOR + (index % 4) * _PORTS_PER_XDIST_WORKER
    start = random.randrange(_PORTS_PER_XDIST_WORKER)  # two runs at once rarely collide
    for step in itertools.count():
        yield low + (start + step) % _PORTS_PER_XDIST_WORKER


_ports = _port_candidates()


def free_port() -> int:
    """A port nothing listens on, that no outgoing connection or other xdist worker will take."""
    for _ in range(_PORTS_PER_XDIST_WORKER):
        port = next(_ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in this xdist worker's block")


def admin_headers(proxy_url: str) -> dict[str, str]:
    """The Authorization header of the admin token that `kvroute proxy`/`up` on this URL made (KVROUTE_CONFIG_DIR)."""
    from proxy.security.tokenfile import token_for

    token = wait_until(lambda: token_for(proxy_url), 10, what=f"the admin token file of {proxy_url}")
    return {"Authorization": f"Bearer {token}"}


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "condition") -> T:
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # the thing we wait for may not answer yet
            last_exc = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc!r})" if last_exc else ""))


def wait_http_ok(url: str, timeout: float = 30.0) -> None:
    wait_until(lambda: httpx.get(url, timeout=1.0).status_code == 200, timeout, 0.1, f"{url} to answer 200")


class Proc:
    def __init__(self, popen: subprocess.Popen[bytes], log_path: Path, name: str) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.log_path = log_path
        self.name = name

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the process group. Returns the exit code."""
        if self.alive():
            try:
                os.killpg(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left in the group (engine children) goes too
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            return self.popen.wait(5)
        except subprocess.TimeoutExpired:
            return None


class ProcessGroup:
    """Starts processes for one test and stops all of them at the end (see the `procs` fixture)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def start(self, args: list[str], name: str = "proc", env: dict[str, str] | None = None,
              cwd: Path | None = None) -> Proc:
        log_path = self.log_dir / f"{name}-{len(self.procs)}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                     cwd=str(cwd or REPO), start_new_session=True)
        proc = Proc(popen, log_path, name)
        self.procs.append(proc)
        return proc

    def kvroute(self, *args: str, name: str = "kvroute", env: dict[str, str] | None = None) -> Proc:
        return self.start([*KVROUTE, *args], name=name, env=env)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def logs(self) -> str:
        return "\n".join(f"===== {p.name} (pid {p.pid}) =====\n{p.log()[-4000:]}" for p in self.procs)
