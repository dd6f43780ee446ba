"""placement: local — each replica a `kvroute worker` subprocess on this machine, in its own process group.

Owns starting the process (asyncio subprocess, log file under the run dir, a free port) and
stopping it (SIGTERM to the worker, SIGKILL to its whole group); not restarts or draining order.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
from pathlib import Path

from proxy.fleet.launcher import WorkerLaunch
from proxy.fleet.ports import PortAllocator

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: if `kvroute up` itself is SIGKILLed, its workers get SIGTERM
    (and drain) instead of living on as orphans. Linux only; elsewhere this is a no-op."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class LocalWorker:
    """Handle on one local worker process (the leader of its own process group)."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str, log_path: Path) -> None:
        self._proc = proc
        self.pid: int | None = proc.pid
        self.url = url
        self.node = "local"
        self.log_path = log_path

    async def wait(self) -> int:
        return await self._proc.wait()

    async def terminate(self) -> None:
        if self._proc.returncode is None:
            try:
                os.kill(self._proc.pid, signal.SIGTERM)  # the worker only: it drains, then stops its engine
            except ProcessLookupError:
                pass

    async def kill(self) -> None:
        try:  # the group outlives its leader while any engine child is left in it
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._proc.returncode is None:
            await self._proc.wait()


class LocalPlacement:
    name = "local"

    def __init__(self, run_dir: Path, host: str = "127.0.0.1") -> None:
        self.run_dir = run_dir
        # Workers bind where the proxy can reach them; 0.0.0.0 binds everywhere but is not an address to dial.
        self.host = host
        self.dial_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.ports = PortAllocator(self.dial_host)

    async def start(self, launch: WorkerLaunch) -> LocalWorker:
        port = self.ports.allocate(launch.worker_id)
        url = f"http://{self.dial_host}:{port}"
        log_path = self.run_dir / f"{launch.worker_id}.log"
        log = await asyncio.to_thread(open, log_path, "ab")
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command(launch, port, url),
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **launch.env()}, start_new_session=True, preexec_fn=_die_with_parent)
        finally:
            log.close()  # the child has its own copy of the descriptor
        return LocalWorker(proc, url, log_path)

    def command(self, launch: WorkerLaunch, port: int, url: str) -> list[str]:
        return launch.argv(self.host, port, advertise_url=url)

    def release(self, worker_id: str) -> None:
        self.ports.release(worker_id)

    async def close(self) -> None:
        return None
