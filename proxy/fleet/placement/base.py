"""The interface every placement implements: start a worker somewhere, and a handle to stop it.

Owns only the shape (Protocols); local.py runs workers as local processes, ray.py as Ray
actors. Supervision, draining order and restarts live in supervisor.py, not here.
"""

from __future__ import annotations

from typing import Protocol

from proxy.fleet.launcher import WorkerLaunch


class WorkerHandle(Protocol):
    """One running worker process, wherever it runs."""

    pid: int | None
    url: str
    node: str

    async def wait(self) -> int:
        """Return the exit code once the worker has exited."""
        ...

    async def terminate(self) -> None:
        """Ask the worker to drain and exit (SIGTERM to the worker, not its engine)."""
        ...

    async def kill(self) -> None:
        """Stop the worker and everything it started, now. Safe to call after it exited."""
        ...


class Placement(Protocol):
    name: str

    async def start(self, launch: WorkerLaunch) -> WorkerHandle:
        ...

    def release(self, worker_id: str) -> None:
        """Forget what was reserved for this worker (its port); called once it is gone for good."""
        ...

    async def close(self) -> None:
        ...
