"""One replica's life: start its worker, restart it with exponential backoff when it crashes, give up
after a crash loop (state `failed`), and stop it by draining.

Owns a replica's process state machine; which replicas should exist is reconcile.py's job, and
where the process runs is the placement's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from proxy.fleet.launcher import WorkerLaunch
from proxy.fleet.placement.base import Placement, WorkerHandle

log = logging.getLogger("kvroute.fleet")

# Replica states, as `kvroute status` and /metrics show them.
PENDING, STARTING, READY, BACKOFF, DRAINING, STOPPED, FAILED = (
    "pending", "starting", "ready", "backoff", "draining", "stopped", "failed")
REPLICA_STATES = (PENDING, STARTING, READY, BACKOFF, DRAINING, STOPPED, FAILED)


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 1.0          # first restart delay; doubles per crash inside the window
    max_backoff_s: float = 30.0
    crash_loop_count: int = 5       # this many crashes ...
    crash_loop_window_s: float = 120.0  # ... within this window: give up, state `failed`

    def delay(self, recent_crashes: int) -> float:
        return min(self.backoff_s * 2 ** max(recent_crashes - 1, 0), self.max_backoff_s)


class Replica:
    """A desired worker and the supervision loop that keeps its process alive."""

    def __init__(self, launch: WorkerLaunch, index: int, generation: int, fingerprint: str,
                 placement: Placement, policy: RestartPolicy,
                 on_crash: Callable[[Replica], Awaitable[Any]] | None = None) -> None:
        self.launch = launch
        self.worker_id = launch.worker_id
        self.model_name = launch.model.name
        self.role = launch.role  # its pool's role (both, prefill, decode, encode)
        self.index = index
        self.generation = generation
        self.fingerprint = fingerprint
        self.placement = placement
        self.policy = policy
        self.on_crash = on_crash  # e.g. tell the proxy to forget the dead process at once
        self.state = PENDING
        self.registered_state: str | None = None  # what the proxy's registry says, fed by the fleet manager
        self.restarts = 0
        self.last_exit_code: int | None = None
        self.last_error: str | None = None
        self.started_at: float | None = None  # wall clock of the current process's start
        self.handle: WorkerHandle | None = None
        self._crashes: deque[float] = deque()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # cuts a backoff sleep short when stopping

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"supervise-{self.worker_id}")

    @property
    def alive(self) -> bool:
        return self.state in (STARTING, READY, BACKOFF, PENDING)

    @property
    def ready(self) -> bool:
        return self.state == READY

    def observe_registry(self, registered_state: str | None, registered_url: str | None = None) -> None:
        """Fold in what the proxy's registry says about this worker (None: not registered).

        Only a registration at the current process's URL counts: after a crash the proxy may still
        hold the dead process's entry, under the same id, for a moment.
        """
        if registered_url is not None and self.handle is not None and registered_url.rstrip("/") != self.handle.url:
            registered_state = None
        self.registered_state = registered_state
        if self.state in (STARTING, READY) and self.handle is not None:
            state = READY if registered_state == "ready" else STARTING
            if state != self.state:
                log.info("%s: %s (proxy says %s)", self.worker_id, state, registered_state or "not registered")
            self.state = state

    async def _supervise(self) -> None:
        while not self._stopping:
            self.state = STARTING
            self.registered_state = None
            try:
                self.handle = await self.placement.start(self.launch)
            except Exception as exc:  # a start that fails is a crash like any other: back off and retry
                log.warning("%s: could not start: %s", self.worker_id, exc)
                self.last_error = f"start failed: {exc}"
                code = None
            else:
                if self._stopping:  # stop() came while the process was being started: it has no drain to wait for
                    await self.handle.terminate()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.handle.wait(), 10.0)
                    await self.handle.kill()
                    break
                self.started_at = time.time()
                log.info("%s: started (pid %s, %s)", self.worker_id, self.handle.pid, self.handle.url)
                code = await self.handle.wait()
                await self.handle.kill()  # engine children left in the group go with it
                self.last_exit_code = code
            if self._stopping:
                break
            if self.on_crash is not None:
                with contextlib.suppress(Exception):
                    await self.on_crash(self)
            if not await self._after_crash(code):
                return

    async def _after_crash(self, code: int | None) -> bool:
        """Record a crash; back off before the next start, or give up on a crash loop. False: gave up."""
        now = time.monotonic()
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self.policy.crash_loop_window_s:
            self._crashes.popleft()
        if code is not None:
            self.last_error = f"exited with code {code}"
        if len(self._crashes) >= self.policy.crash_loop_count:
            self.state = FAILED
            self.last_error = (f"crash loop: {len(self._crashes)} crashes within "
                               f"{self.policy.crash_loop_window_s:g}s (last: {self.last_error})")
            log.error("%s: %s; giving up", self.worker_id, self.last_error)
            self.placement.release(self.worker_id)
            return False
        delay = self.policy.delay(len(self._crashes))
        log.warning("%s: %s; restarting in %.1fs", self.worker_id, self.last_error, delay)
        self.state = BACKOFF
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), delay)
        self.restarts += 1
        return True

    async def stop(self, grace_s: float, drain: Callable[[], Awaitable[Any]] | None = None) -> None:
        """Drain and stop: `drain` tells the proxy to send nothing new; the worker gets SIGTERM, finishes
        its in-flight requests (up to its own grace), deregisters and exits; after `grace_s` plus a
        margin it is killed."""
        self._stopping = True
        self._wake.set()
        was_failed = self.state == FAILED
        self.state = DRAINING
        if drain is not None and not was_failed:
            with contextlib.suppress(Exception):
                await drain()
        handle = self.handle
        if handle is not None:
            await handle.terminate()
            try:
                await asyncio.wait_for(asyncio.shield(handle.wait()), grace_s + 10.0)
            except TimeoutError:
                log.warning("%s: still running %.0fs after SIGTERM; killing it", self.worker_id, grace_s + 10)
            await handle.kill()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._task, 5.0)
        self.placement.release(self.worker_id)
        self.state = STOPPED

    async def kill(self) -> None:
        """Stop at once, no drain (second Ctrl-C)."""
        self._stopping = True
        self._wake.set()
        if self.handle is not None:
            await self.handle.kill()
        self.state = STOPPED

    def snapshot(self) -> dict[str, Any]:
        h = self.handle
        return {
            "worker_id": self.worker_id, "model": self.model_name, "role": self.role, "index": self.index,
            "generation": self.generation, "state": self.state, "registered_state": self.registered_state,
            "engine": self.launch.model.engine, "placement": self.placement.name,
            "url": h.url if h else None, "node": h.node if h else None, "pid": h.pid if h else None,
            "gpus": getattr(h, "gpus", None) or self.launch.gpus or [], "restarts": self.restarts, "last_exit_code": self.last_exit_code,
            "last_error": self.last_error, "started_at": self.started_at, "fingerprint": self.fingerprint,
        }
