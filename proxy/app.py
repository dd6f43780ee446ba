"""Build the proxy's aiohttp application, and serve it behind the data plane.

Owns wiring: which objects exist per app (registry, live config, routing service, probe session,
metrics, monitor), the control-plane routes, startup/cleanup; `serve` runs the data plane on a
host/port in the current event loop with the app behind it. The fleet launcher adds its own /fleet
routes before starting the app.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from proxy import gctuning
from proxy.api import control, openapi, ops, tokenizers
from proxy.api import openai as openai_api
from proxy.config import FleetConfig
from proxy.errors import error_response, shutting_down
from proxy.observability.cache_prediction import CachePredictionMetrics
from proxy.observability.metrics import ProxyMetrics
from proxy.routing.base import PolicyDeps
from proxy.routing.live import LiveConfig
from proxy.routing.live_changes import ConfigChange, merge
from proxy.routing.policy_set import PolicySet
from proxy.routing.prefix_index import PrefixIndex
from proxy.routing.service import RoutingService
from proxy.security import peer
from proxy.security.clientauth import ClientAuth, client_keys_middleware
from proxy.security.limits import limits_middleware, parser_limits
from proxy.workers.engine_probe import EngineProbe
from proxy.workers.monitor import HealthMonitor
from proxy.workers.probe_session import Upstream
from proxy.workers.redis_mirror import RedisState
from proxy.workers.registry import Registry

log = logging.getLogger("kvroute.proxy")

REGISTRY_KEY = web.AppKey("kvroute_registry", Registry)
CONFIG_KEY = web.AppKey("kvroute_config", FleetConfig)
LIVE_KEY = web.AppKey("kvroute_live", LiveConfig)
ROUTING_KEY = web.AppKey("kvroute_routing", RoutingService)
CLIENT_AUTH_KEY = web.AppKey("kvroute_client_auth", ClientAuth)
UPSTREAM_KEY = web.AppKey("kvroute_upstream", Upstream)
MONITOR_KEY = web.AppKey("kvroute_monitor", HealthMonitor)
METRICS_KEY = web.AppKey("kvroute_metrics", ProxyMetrics)
STATE_KEY = web.AppKey("kvroute_state", RedisState)  # present only with state: redis://...

# A stopping proxy looks again after every finished request, and at least this often.
DRAIN_CHECK_S = 0.25
# What aiohttp still gives its handlers (long-lived event streams) once the drain is over.
HANDLER_SHUTDOWN_S = 1.0


class Lifecycle:
    """Stopping gracefully: new /v1 requests get 503 `shutting_down` at once, the ones in flight finish
    (bounded by drain_grace_s); and the policy named on the command line, which config edits do not change."""

    def __init__(self, registry: Registry, routing: RoutingService, policy_override: str | None) -> None:
        self.registry = registry
        self.routing = routing
        self.policy_override = policy_override
        self.shutting_down = False
        self.on_shutdown: list[Callable[[], None]] = []  # the data plane's own gate

    def begin_shutdown(self) -> None:
        if not self.shutting_down:
            self.shutting_down = True
            log.info("shutting down: refusing new requests, finishing those in flight")
            for hook in self.on_shutdown:
                hook()

    def in_flight(self) -> int:
        """Requests sent to a worker or waiting in an admission queue."""
        return (sum(w.load.in_flight for w in self.registry.workers())
                + sum(self.routing.queue_lengths().values()))

    async def drain(self, grace_s: float) -> bool:
        """begin_shutdown(), then wait until nothing is in flight; False when grace_s ran out first."""
        self.begin_shutdown()
        deadline = time.monotonic() + grace_s
        while (left := self.in_flight()) and (remaining := deadline - time.monotonic()) > 0:
            # every finished request notifies the registry; the cap covers requests leaving a queue
            await asyncio.wait({self.registry.changed()}, timeout=min(remaining, DRAIN_CHECK_S))
        if left:
            log.warning("drain grace (%gs) over with %d requests in flight; stopping anyway", grace_s, left)
        return not left


LIFECYCLE_KEY = web.AppKey("kvroute_lifecycle", Lifecycle)


def build_app(config: FleetConfig, *, policy: str | None = None) -> web.Application:
    """A not-yet-started proxy app for `config`; `policy` overrides config.proxy.policy.

    Raises ValueError for an unknown policy name (global or per model).
    """
    proxy_cfg = config.proxy
    registry = Registry()
    deps = PolicyDeps(prefix_index=PrefixIndex())
    registry.add_listener(deps.engine_blocks.on_registry_event)  # the engines' KV events ride in their reports
    live = LiveConfig(config, PolicySet(config, policy or proxy_cfg.policy, deps))
    routing = RoutingService(live, registry)
    upstream = Upstream(proxy_cfg.timeouts)
    metrics = ProxyMetrics(registry)
    metrics.watch_engine_blocks(deps.engine_blocks)
    metrics.collector_registry.register(CachePredictionMetrics(registry, routing.feedback))  # answers vs predictions
    monitor = HealthMonitor(registry, upstream)
    client_auth = ClientAuth.from_config(config)  # raises ValueError for an unreadable key file

    # aiohttp refuses bodies over client_max_size while reading (the data plane already did, in front).
    app = web.Application(client_max_size=proxy_cfg.max_body_bytes,
                          middlewares=[openai_errors, shutdown_gate, client_keys_middleware(client_auth),
                                       limits_middleware(config, registry), control.auth_middleware(proxy_cfg)])
    app[REGISTRY_KEY] = registry
    app[CONFIG_KEY] = config
    app[LIVE_KEY] = live
    app[ROUTING_KEY] = routing
    app[CLIENT_AUTH_KEY] = client_auth
    app[UPSTREAM_KEY] = upstream
    app[MONITOR_KEY] = monitor
    app[METRICS_KEY] = metrics
    app[LIFECYCLE_KEY] = Lifecycle(registry, routing, policy)
    if config.state.url != "memory":
        app[STATE_KEY] = RedisState(registry, config.state, proxy_cfg, on_dropped=metrics.redis_dropped)

    openai_api.add_routes(app, registry, live)
    control.add_routes(app, registry, monitor, routing.queue_lengths)
    tokenizers.add_routes(app, registry, routing.tokenizers)
    ops.add_routes(app, registry, metrics, routing.queue_lengths)
    openapi.add_routes(app)
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


@web.middleware
async def shutdown_gate(request: web.Request, handler: control.Handler) -> web.StreamResponse:
    """While stopping, /ready says so (load balancers look); the data plane refuses new completions itself."""
    if request.app[LIFECYCLE_KEY].shutting_down and request.path == "/ready":
        return shutting_down().response()
    return await handler(request)


def apply_config(app: web.Application, config: FleetConfig) -> ConfigChange:
    """A new config while running (`kvroute up`'s file edits and `kvroute apply`): models, aliases,
    per-model policies and the live proxy keys (liveconfig.LIVE_PROXY_KEYS) hold from the next request;
    the other proxy keys keep their running values and are listed in the result."""
    live = app[LIVE_KEY]
    change = merge(live.config, config)
    new = change.config
    lifecycle = app[LIFECYCLE_KEY]
    policies = PolicySet(new, lifecycle.policy_override or new.proxy.policy, live.policies.deps,
                         reuse=live.policies)  # ValueError for an unknown name: nothing changed yet
    live.update(new, policies)
    if "proxy.log_level" in change.live:
        logging.getLogger().setLevel(new.proxy.log_level.upper())
    return change


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
    await app[CLIENT_AUTH_KEY].close()


async def serve(app: web.Application, host: str, port: int) -> None:
    """Run the data plane on host:port, with `app` behind it on an internal unix socket, until cancelled; then
    close both cleanly. Prints the bound URL. /v1 completions are the data plane's (proxy/dataplane/); every
    other route is handed to `app`."""
    from proxy.dataplane.server import DataPlane

    gctuning.tune_for_serving()
    config = app[CONFIG_KEY]
    hop_secret = peer.install(app)  # before start-up: a started app is frozen
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=HANDLER_SHUTDOWN_S, **parser_limits(config))
    await runner.setup()
    sockdir = tempfile.mkdtemp(prefix="kvroute-")  # mode 0700: only this user reaches the control socket
    plane: DataPlane | None = None
    lifecycle = app[LIFECYCLE_KEY]
    try:
        path = os.path.join(sockdir, "control.sock")
        await web.UnixSite(runner, path).start()
        plane = DataPlane(app[LIVE_KEY], app[ROUTING_KEY], app[REGISTRY_KEY], app[METRICS_KEY],
                          app[CLIENT_AUTH_KEY], path, hop_secret,
                          probe=EngineProbe(app[REGISTRY_KEY], app[UPSTREAM_KEY]))
        lifecycle.on_shutdown.append(plane.begin_shutdown)
        bound = await plane.start(host, port)
        print(f"kvroute proxy listening on http://{host}:{bound}", flush=True)
        await asyncio.Event().wait()
    finally:
        await lifecycle.drain(app[LIVE_KEY].proxy.drain_grace_s)  # a 2nd cancel: at once
        if plane is not None:
            await plane.close()
        await runner.cleanup()
        shutil.rmtree(sockdir, ignore_errors=True)
