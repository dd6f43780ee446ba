"""Runs the proxy app inside `kvroute up`'s event loop, with the fleet's routes and metrics added.

Owns only the wiring between proxy.app and the fleet manager and waiting until the proxy
answers; the proxy itself is proxy/app.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

import aiohttp

from proxy.config import FleetConfig
from proxy.fleet.api import add_fleet_routes, register_fleet_metrics
from proxy.fleet.reconcile import FleetManager

if TYPE_CHECKING:
    from proxy.app import Lifecycle


async def start_proxy(config: FleetConfig, manager: FleetManager, host: str, port: int,
                      policy: str | None = None, within_s: float = 30.0) -> RunningProxy:
    """Start serving; return once /health answers. Calling the result stops the proxy."""
    from proxy.app import LIFECYCLE_KEY, METRICS_KEY, apply_config, build_app, serve

    app = build_app(config, policy=policy)
    add_fleet_routes(app, manager)
    # Models, aliases, per-model policies and the live proxy keys of an edit hold from the next request.
    manager.on_apply.append(lambda new: apply_config(app, new))
    register_fleet_metrics(app[METRICS_KEY].collector_registry, manager)
    task = asyncio.create_task(serve(app, host, port), name="kvroute-proxy")
    dial = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while True:
            if task.done():
                task.result()  # raises what stopped it (port in use, ...)
                raise RuntimeError("the proxy stopped during start-up")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(f"http://{dial}:{port}/health") as resp:
                    if resp.status < 500:
                        break
            if time.monotonic() > deadline:
                task.cancel()
                raise RuntimeError(f"the proxy did not answer on {dial}:{port} within {within_s:g}s")
            await asyncio.sleep(0.05)

    return RunningProxy(task, app[LIFECYCLE_KEY])


class RunningProxy:
    """The proxy task of `kvroute up`: `await drain(grace)` refuses new requests and lets those in flight
    finish; `await stop()` (or calling the object) ends it."""

    def __init__(self, task: asyncio.Task[None], lifecycle: Lifecycle) -> None:
        self.task = task
        self.lifecycle = lifecycle

    async def drain(self, grace_s: float) -> bool:
        return await self.lifecycle.drain(grace_s)

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    async def __call__(self) -> None:
        await self.stop()
