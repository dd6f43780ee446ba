"""Operations endpoints: GET /health (liveness), GET /ready (a worker can serve), GET /metrics, and the
dashboard's routes (/dashboard, /dashboard/state, /dashboard/events; see proxy/api/dashboard.py).

Owns registering these routes; metric definitions are in proxy/observability/metrics.py.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from proxy.api import dashboard
from proxy.observability.metrics import ProxyMetrics
from proxy.workers.registry import Registry, WorkerState


def add_routes(app: web.Application, registry: Registry, metrics: ProxyMetrics,
               queue_lengths: Callable[[], dict[str, int]] = dict) -> None:
    async def health(request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def ready(request: web.Request) -> web.Response:
        now = registry.clock()
        states = [w.state(now) for w in registry.workers()]
        ready_count = sum(1 for s in states if s is WorkerState.READY)
        body = {"status": "ready" if ready_count else "no_ready_worker", "ready_workers": ready_count,
                "workers": len(states)}
        return _json(body, status=200 if ready_count else 503)

    async def metrics_view(request: web.Request) -> web.Response:
        resp = web.Response(body=metrics.render())
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics_view)
    dashboard.add_routes(app, registry, metrics, queue_lengths)


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")
