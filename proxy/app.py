"""Build the proxy's aiohttp application, and serve it.

Owns wiring: which objects exist per app (registry, upstream session, policies, metrics,
monitor), the routes, startup/cleanup; `serve` runs an app on a host/port in the current
event loop. The fleet launcher adds its own /fleet routes before starting the app.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator

from aiohttp import web

from proxy.api import control, ops
from proxy.api import openai as openai_api
from proxy.config import FleetConfig
from proxy.dispatch import Dispatcher, PolicySet
from proxy.errors import error_response
from proxy.metrics import ProxyMetrics
from proxy.monitor import HealthMonitor
from proxy.registry import Registry
from proxy.routing.base import PolicyDeps
from proxy.routing.prefix_index import PrefixIndex
from proxy.security import peer
from proxy.security.clientauth import ClientAuth, client_keys_middleware
from proxy.security.limits import LimitedTCPSite, limits_middleware, parser_limits
from proxy.state import RedisState
from proxy.upstream import Upstream

log = logging.getLogger("kvroute.proxy")

REGISTRY_KEY = web.AppKey("kvroute_registry", Registry)
CONFIG_KEY = web.AppKey("kvroute_config", FleetConfig)
DISPATCHER_KEY = web.AppKey("kvroute_dispatcher", Dispatcher)
UPSTREAM_KEY = web.AppKey("kvroute_upstream", Upstream)
MONITOR_KEY = web.AppKey("kvroute_monitor", HealthMonitor)
METRICS_KEY = web.AppKey("kvroute_metrics", ProxyMetrics)
STATE_KEY = web.AppKey("kvroute_state", RedisState)  # present only with state: redis://...


def build_app(config: FleetConfig, *, policy: str | None = None) -> web.Application:
    """A not-yet-started proxy app for `config`; `policy` overrides config.proxy.policy.

    Raises ValueError for an unknown policy name (global or per model).
    """
    proxy_cfg = config.proxy
    registry = Registry()
    deps = PolicyDeps(prefix_index=PrefixIndex())
    policies = PolicySet(config, policy or proxy_cfg.policy, deps)
    upstream = Upstream(proxy_cfg.timeouts)
    metrics = ProxyMetrics(registry)
    monitor = HealthMonitor(registry, upstream)
    client_auth = ClientAuth.from_config(config)  # raises ValueError for an unreadable key file
    dispatcher = Dispatcher(config, registry, upstream, policies, metrics, client_auth=client_auth)

    # aiohttp refuses bodies over client_max_size while reading; dispatch turns that into a 413.
    app = web.Application(client_max_size=proxy_cfg.max_body_bytes,
                          middlewares=[openai_errors, client_keys_middleware(client_auth),
                                       limits_middleware(config, registry), control.auth_middleware(proxy_cfg)])
    app[REGISTRY_KEY] = registry
    app[CONFIG_KEY] = config
    app[DISPATCHER_KEY] = dispatcher
    app[UPSTREAM_KEY] = upstream
    app[MONITOR_KEY] = monitor
    app[METRICS_KEY] = metrics
    if config.state.url != "memory":
        app[STATE_KEY] = RedisState(registry, config.state.url)

    openai_api.add_routes(app, dispatcher, registry, config)
    control.add_routes(app, registry, monitor, dispatcher.queue_lengths)
    ops.add_routes(app, registry, metrics, dispatcher.queue_lengths)
    app.cleanup_ctx.append(_lifecycle)
    return app


@web.middleware
async def openai_errors(request: web.Request, handler: control.Handler) -> web.StreamResponse:
    """Unknown paths, wrong methods and unexpected failures also answer in OpenAI's error body."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err_type = "invalid_request_error" if exc.status < 500 else "server_error"
        return error_response(exc.status, exc.reason, err_type, code=exc.reason.lower().replace(" ", "_"),
                              headers={k: v for k, v in exc.headers.items() if k.lower() == "allow"})
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return error_response(500, "The proxy failed to handle this request.", "server_error",
                              code="internal_error")


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    upstream, monitor = app[UPSTREAM_KEY], app[MONITOR_KEY]
    state = app.get(STATE_KEY)
    await upstream.start()
    if state is not None:
        await state.start()  # before serving: a restarted proxy has its fleet back at once
    monitor.start()
    for static in app[CONFIG_KEY].proxy.static_workers:
        monitor.spawn(monitor.add_static(static.url, static.models, static.engine))
    yield
    await monitor.stop()
    if state is not None:
        await state.stop()
    await upstream.close()
    await app[DISPATCHER_KEY].client_auth.close()


async def serve(app: web.Application, host: str, port: int, data_plane: str | None = None) -> None:
    """Run `app` on host:port until cancelled; then close it cleanly. Prints the bound URL.

    data_plane "fast" (the default; KVROUTE_DATA_PLANE=aiohttp or --data-plane aiohttp for the old path):
    /v1 completions on proxy/dataplane/, every other route on `app` behind it on an internal unix socket.
    """
    data_plane = data_plane or os.environ.get("KVROUTE_DATA_PLANE", "fast")
    if data_plane == "aiohttp":
        await _serve_aiohttp(app, host, port)
        return
    from proxy.dataplane.server import DataPlane

    config = app[CONFIG_KEY]
    hop_secret = peer.install(app)  # before start-up: a started app is frozen
    runner = web.AppRunner(app, access_log=None, **parser_limits(config))
    await runner.setup()
    sockdir = tempfile.mkdtemp(prefix="kvroute-")  # mode 0700: only this user reaches the control socket
    plane: DataPlane | None = None
    try:
        path = os.path.join(sockdir, "control.sock")
        await web.UnixSite(runner, path).start()
        dispatcher = app[DISPATCHER_KEY]
        plane = DataPlane(config, dispatcher, app[REGISTRY_KEY], app[METRICS_KEY], dispatcher.client_auth, path,
                          hop_secret)
        bound = await plane.start(host, port)
        print(f"kvroute proxy listening on http://{host}:{bound}", flush=True)
        await asyncio.Event().wait()
    finally:
        if plane is not None:
            await plane.close()
        await runner.cleanup()
        shutil.rmtree(sockdir, ignore_errors=True)


async def _serve_aiohttp(app: web.Application, host: str, port: int) -> None:
    """The previous data plane: everything on aiohttp."""
    # handler_cancellation: a client that disconnects cancels its handler, and with it the
    # upstream request (the worker sees the connection close and stops generating).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, **parser_limits(app[CONFIG_KEY]))
    await runner.setup()
    try:
        site = LimitedTCPSite(runner, host, port, app[CONFIG_KEY].proxy.limits, backlog=1024, reuse_address=True)
        await site.start()
        bound = runner.addresses[0]
        print(f"kvroute proxy listening on http://{host}:{bound[1]}", flush=True)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
