"""Runs the proxy app inside `kvroute up`'s event loop, with the fleet's routes and metrics added.

Owns only the wiring between proxy.app and the fleet manager and waiting until the proxy
answers; the proxy itself is proxy/app.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import aiohttp

from proxy.config import FleetConfig
from proxy.fleet.api import add_fleet_routes, register_fleet_metrics
from proxy.fleet.reconcile import FleetManager


async def start_proxy(config: FleetConfig, manager: FleetManager, host: str, port: int,
                      policy: str | None = None, within_s: float = 30.0) -> Callable[[], Awaitable[None]]:
    """Start serving; return once /health answers. The result stops the proxy."""
    from proxy.app import DISPATCHER_KEY, METRICS_KEY, build_app, serve

    app = build_app(config, policy=policy)
    add_fleet_routes(app, manager)
    dispatcher = app[DISPATCHER_KEY]

    def follow_models(new: FleetConfig) -> None:
        # Models and aliases added by an edit must resolve at once; proxy settings still need a restart.
        dispatcher.config = dispatcher.config.model_copy(update={"models": new.models})

    manager.on_apply.append(follow_models)
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

    async def stop() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return stop
