"""GET /dashboard (the page), /dashboard/state (one JSON frame) and /dashboard/events (frames as SSE).

Owns these routes and the event stream's limits; what a frame holds is
proxy/observability/dashboard_feed.py's. Read-only and free of secrets, so it needs no token;
the page's admin actions call the guarded control plane with the token the user types in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from proxy.errors import error_response
from proxy.observability.dashboard_feed import DashboardFeed, TooManyListeners
from proxy.observability.metrics import ProxyMetrics
from proxy.workers.registry import Registry

STATIC_DIR = Path(__file__).with_name("static")
FEED_KEY = web.AppKey("kvroute_dashboard_feed", DashboardFeed)
# Set by `kvroute up` (proxy/fleet/api.py), which builds on this app: the fleet manager's view, for the page.
FLEET_SNAPSHOT_KEY: web.AppKey[Callable[[], dict[str, Any]]] = web.AppKey("kvroute_fleet_snapshot")
KEEPALIVE_S = 15.0    # an SSE comment line keeps idle proxies and browsers from closing the stream
WRITE_TIMEOUT_S = 10.0  # a page that stops reading is dropped instead of holding frames


def add_routes(app: web.Application, registry: Registry, metrics: ProxyMetrics,
               queue_lengths: Callable[[], dict[str, int]]) -> None:
    feed = DashboardFeed(registry, metrics, queue_lengths, lambda: _fleet_snapshot(app))
    app[FEED_KEY] = feed

    async def page(request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "dashboard.html", headers={"Cache-Control": "no-cache"})

    async def state(request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(feed.frame()), content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    async def events(request: web.Request) -> web.StreamResponse:
        try:
            queue = feed.add_listener()
        except TooManyListeners as exc:
            return error_response(503, f"{exc}; try again later.", "service_unavailable",
                                  code="too_many_dashboards", headers={"Retry-After": "5"})
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                               "X-Accel-Buffering": "no"})
            await resp.prepare(request)
            await _send(resp, b"retry: 2000\ndata: " + orjson.dumps(feed.frame()) + b"\n\n")
            while not _gone(request):
                try:
                    data = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                    chunk = b"data: " + data + b"\n\n"
                except TimeoutError:
                    chunk = b": keepalive\n\n"
                await _send(resp, chunk)
        except (ConnectionError, TimeoutError, asyncio.CancelledError):
            pass  # the page went away (closed, reloaded, or stopped reading): stop streaming to it
        finally:
            feed.remove_listener(queue)
        return resp

    app.router.add_get("/dashboard", page)
    app.router.add_get("/dashboard/", page)
    app.router.add_get("/dashboard/state", state)
    app.router.add_get("/dashboard/events", events)
    app.router.add_static("/dashboard/static", STATIC_DIR)
    app.cleanup_ctx.append(_run_feed)


async def _run_feed(app: web.Application) -> Any:
    feed = app[FEED_KEY]
    feed.start()
    yield
    await feed.stop()


async def _send(resp: web.StreamResponse, chunk: bytes) -> None:
    await asyncio.wait_for(resp.write(chunk), WRITE_TIMEOUT_S)


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _fleet_snapshot(app: web.Application) -> dict[str, Any] | None:
    """The fleet manager's view when the proxy runs inside `kvroute up`; None for a plain proxy."""
    snapshot = app.get(FLEET_SNAPSHOT_KEY)
    return None if snapshot is None else snapshot()

