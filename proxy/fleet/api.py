"""The fleet's admin HTTP routes on the proxy app (/fleet, /fleet/apply, /fleet/scale) and its metrics.

Owns request/response shapes for fleet control and the Prometheus collector that reads the
manager at scrape time; admin auth is the control plane's (proxy/api/control.py covers /fleet*: admin only).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import orjson
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from proxy.api.dashboard import FLEET_SNAPSHOT_KEY
from proxy.config import ConfigError, parse_config
from proxy.fleet.gpus import GpuAssignmentError
from proxy.fleet.reconcile import FleetManager
from proxy.fleet.scalefile import ScaleWriteError, write_replicas
from proxy.fleet.supervisor import REPLICA_STATES
from proxy.pools import ROLES

log = logging.getLogger("kvroute.fleet")

FLEET_MANAGER_KEY: web.AppKey[FleetManager] = web.AppKey("kvroute_fleet_manager", FleetManager)
# Most replicas of one model that /fleet/scale or /fleet/apply may ask for (a typo must not fork-bomb the host).
MAX_REPLICAS = 256


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


def _error(status: int, message: str, code: str, param: str | None = None) -> web.Response:
    err_type = "invalid_request_error" if status < 500 else "server_error"
    return _json({"error": {"message": message, "type": err_type, "param": param, "code": code}}, status)


async def get_fleet(request: web.Request) -> web.Response:
    return _json(request.app[FLEET_MANAGER_KEY].snapshot())


async def post_apply(request: web.Request) -> web.Response:
    """Body: the config file's text (YAML), already interpolated by `kvroute apply`.

    `${VAR}` is not resolved from the proxy's environment here (only `${VAR:-default}` takes its
    default): a config sent over HTTP must not read the proxy's secrets back through GET /fleet.
    """
    text = await request.text()
    try:
        config = parse_config(text, source="applied config", env={})
        too_many = [m.name for m in config.models if any(p.replicas > MAX_REPLICAS for p in m.pool_list())]
        if too_many:
            return _error(400, f"at most {MAX_REPLICAS} replicas per model over HTTP ({', '.join(too_many)})",
                          "too_many_replicas", "replicas")
        plan = request.app[FLEET_MANAGER_KEY].apply(config)
    except ConfigError as exc:
        return _error(400, str(exc), "invalid_config")
    except GpuAssignmentError as exc:
        return _error(409, str(exc), "does_not_fit")
    return _json({"plan": plan})


async def post_scale(request: web.Request) -> web.Response:
    try:
        body = orjson.loads(await request.read())
        model, replicas, role = body["model"], body["replicas"], body.get("role")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return _error(400, 'body must be JSON {"model": NAME, "replicas": N, "role": ROLE (a pool\'s, optional)}',
                      "invalid_request")
    if not isinstance(model, str) or not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        return _error(400, "model must be a string and replicas an integer >= 0", "invalid_request", "replicas")
    if role is not None and role not in ROLES:
        return _error(400, f"role must be one of {', '.join(ROLES)}", "invalid_request", "role")
    if replicas > MAX_REPLICAS:
        return _error(400, f"at most {MAX_REPLICAS} replicas per model", "too_many_replicas", "replicas")
    manager = request.app[FLEET_MANAGER_KEY]
    try:
        plan = manager.scale(model, replicas) if role is None else manager.scale(model, replicas, role)
    except KeyError:
        return _error(404, f"no model or alias named '{model}' in the fleet", "model_not_found", "model")
    except ValueError as exc:  # a pooled model without a role, or a role it has no pool of
        return _error(400, str(exc), "invalid_request", "role")
    except GpuAssignmentError as exc:
        return _error(409, str(exc), "does_not_fit", "replicas")
    path = manager.config_path
    if path is not None:  # the file keeps saying what runs, so its next edit does not undo this scale
        name = manager.desired.model(model).name  # type: ignore[union-attr]  # scale() found it
        try:
            await asyncio.to_thread(write_replicas, path, name, replicas, role)
            if manager.config_rewritten is not None:  # the watcher: an edit back to the old text is a change
                manager.config_rewritten()
            what = f"the {role} pool of {name}" if role and role != "both" else name
            plan["config file"] = f"{path}: replicas of {what} set to {replicas} (comments kept)"
        except ScaleWriteError as exc:
            log.warning("kvroute scale could not update %s: %s", path, exc)
            plan["config file"] = (f"NOT updated ({exc}); its next edit sets the replicas it says, "
                                   f"undoing this scale")
    return _json({"plan": plan})


def add_fleet_routes(app: web.Application, manager: FleetManager) -> None:
    """Mount the fleet routes; call before the app starts."""
    app[FLEET_MANAGER_KEY] = manager
    app[FLEET_SNAPSHOT_KEY] = manager.snapshot  # the dashboard's fleet panel
    app.router.add_get("/fleet", get_fleet)
    app.router.add_post("/fleet/apply", post_apply)
    app.router.add_post("/fleet/scale", post_scale)


class FleetCollector(Collector):
    """Reads replica states from the manager at scrape time, so there is no second copy to keep in sync."""

    def __init__(self, manager: FleetManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        replicas = GaugeMetricFamily("kvroute:fleet_replicas", "Replicas managed by `kvroute up`, by state",
                                     labels=["model", "state"])
        desired = GaugeMetricFamily("kvroute:fleet_desired_replicas", "Replicas the config asks for",
                                    labels=["model"])
        restarts = CounterMetricFamily("kvroute:fleet_restarts", "Worker restarts after a crash", labels=["model"])
        pool_replicas = GaugeMetricFamily("kvroute:fleet_pool_replicas",
                                          "Replicas managed by `kvroute up`, by pool role and state",
                                          labels=["model", "role", "state"])
        pool_desired = GaugeMetricFamily("kvroute:fleet_pool_desired_replicas", "Replicas the config asks of each pool",
                                         labels=["model", "role"])
        models = {m.name for m in self.manager.desired.models} | {r.model_name for r in self.manager.replicas.values()}
        for model in sorted(models):
            rs = [r for r in self.manager.replicas.values() if r.model_name == model]
            for state in REPLICA_STATES:
                replicas.add_metric([model, state], sum(r.state == state for r in rs))
            m = self.manager.desired.model(model)
            desired.add_metric([model], sum(p.replicas for p in m.pool_list()) if m and m.name == model else 0)
            restarts.add_metric([model], sum(r.restarts for r in rs))
            desired_pools = {p.role: p.replicas for p in m.pool_list()} if m and m.name == model else {}
            for role in sorted(set(desired_pools) | {r.role for r in rs}):
                pool_desired.add_metric([model, role], desired_pools.get(role, 0))
                for state in REPLICA_STATES:
                    pool_replicas.add_metric([model, role, state], sum(r.state == state for r in rs if r.role == role))
        yield replicas
        yield desired
        yield restarts
        yield pool_replicas
        yield pool_desired

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # collected lazily: the model set changes at run time


def register_fleet_metrics(registry: CollectorRegistry, manager: FleetManager) -> FleetCollector:
    collector = FleetCollector(manager)
    registry.register(collector)
    return collector
