"""The control plane: worker registration, load reports, drain/remove, and LMDeploy's /nodes API.

Owns these routes and the token check that guards them (and /fleet*); what registering or
draining means is the registry's business, probing a URL-only worker is the monitor's.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

import aiohttp
import orjson
from aiohttp import web
from pydantic import ValidationError
from yarl import URL

from proxy.config import ProxyConfig
from proxy.errors import error_response
from proxy.monitor import HealthMonitor
from proxy.protocol import LoadReport, RegistrationAccepted, WorkerRegistration
from proxy.registry import Registry

log = logging.getLogger("kvroute.control")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_GUARDED_PREFIXES = ("/workers", "/nodes", "/fleet")


def _is_worker_route(request: web.Request) -> bool:
    """Routes a worker itself calls: register, report, deregister, LMDeploy's self-registration."""
    path = request.path
    if request.method == "POST" and path in ("/workers", "/nodes/add"):
        return True
    if path.startswith("/workers/"):
        return (request.method == "POST" and path.endswith("/report")) or request.method == "DELETE"
    return False


def auth_middleware(config: ProxyConfig) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Bearer-token check for the control plane; open when no token is configured."""

    @web.middleware
    async def check_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith(_GUARDED_PREFIXES):
            return await handler(request)
        accepted = [t for t in (config.admin_token,) if t]
        if _is_worker_route(request) and config.worker_token:
            accepted.append(config.worker_token)
        if accepted:
            given = request.headers.get("Authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not any(hmac.compare_digest(token.encode(), t.encode()) for t in accepted):
                return error_response(401, "A valid bearer token is required for the control plane.",
                                      "authentication_error", code="invalid_api_key")
        return await handler(request)

    return check_token


def add_routes(app: web.Application, registry: Registry, monitor: HealthMonitor,
               queue_lengths: Callable[[], dict[str, int]]) -> None:
    async def register(request: web.Request) -> web.Response:
        try:
            reg = WorkerRegistration.model_validate_json(await request.read())
        except ValidationError as exc:
            return _invalid(exc)
        if not _is_worker_url(reg.url):
            return error_response(400, f"`url` must be http(s)://host[:port], got {reg.url!r}.", param="url",
                                  code="invalid_url")
        worker = registry.register(reg)
        log.info("registered %s at %s serving %s", worker.worker_id, worker.url, ",".join(worker.models))
        return _json(RegistrationAccepted(worker_id=worker.worker_id).model_dump())

    async def report(request: web.Request) -> web.Response:
        worker_id = request.match_info["worker_id"]
        try:
            load = LoadReport.model_validate_json(await request.read())
        except ValidationError as exc:
            return _invalid(exc)
        if load.worker_id != worker_id:
            return error_response(400, f"report for `{load.worker_id}` sent to /workers/{worker_id}/report",
                                  param="worker_id")
        if not registry.record_report(worker_id, load):
            return _unknown(worker_id)
        return _json({"ok": True})

    async def list_workers(request: web.Request) -> web.Response:
        now = registry.clock()
        return _json({"workers": [w.to_json(now) for w in registry.workers()], "queues": queue_lengths()})

    async def get_worker(request: web.Request) -> web.Response:
        worker = registry.get(request.match_info["worker_id"])
        if worker is None:
            return _unknown(request.match_info["worker_id"])
        return _json(worker.to_json(registry.clock()))

    async def drain(request: web.Request) -> web.Response:
        worker = registry.drain(request.match_info["worker_id"])
        if worker is None:
            return _unknown(request.match_info["worker_id"])
        log.info("draining %s", worker.worker_id)
        return _json(worker.to_json(registry.clock()))

    async def remove(request: web.Request) -> web.Response:
        worker = registry.remove(request.match_info["worker_id"])
        if worker is None:
            return _unknown(request.match_info["worker_id"])
        log.info("removed %s", worker.worker_id)
        return _json({"removed": worker.worker_id})

    # --- LMDeploy compatibility (`lmdeploy serve api_server --proxy-url`, `lmdeploy serve proxy` clients)
    async def nodes_add(request: web.Request) -> web.Response:
        body = await _json_body(request)
        url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str) or not _is_worker_url(url):
            return error_response(400, "`url` (http://host:port) is required.", param="url")
        status = body.get("status") if isinstance(body.get("status"), dict) else {}
        listed = status.get("models")
        models = [m for m in listed if isinstance(m, str)] if isinstance(listed, list) else []
        labels = {"role": str(status.get("role", "Hybrid"))}
        if isinstance(status.get("speed"), int | float):
            labels["speed"] = str(status["speed"])
        try:
            worker = await monitor.add_by_url(url, models or None, source="nodes", labels=labels)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            return error_response(400, f"Could not read the models of {url} from its /v1/models: {exc}",
                                  param="url", code="worker_unreachable")
        log.info("node %s added as %s serving %s", url, worker.worker_id, ",".join(worker.models))
        return _json({"worker_id": worker.worker_id, "models": list(worker.models),
                      "message": "Added successfully"})

    async def nodes_remove(request: web.Request) -> web.Response:
        url = request.query.get("node_url") or request.query.get("url")
        if url is None:
            body = await _json_body(request)
            url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str):
            return error_response(400, "`url` is required.", param="url")
        worker = registry.remove_url(url)
        if worker is None:
            return error_response(404, f"No node with url {url}.", code="worker_not_found")
        return _json({"removed": worker.worker_id, "message": "Deleted successfully"})

    async def nodes_status(request: web.Request) -> web.Response:
        out = {}
        for worker in registry.workers():
            out[worker.url] = {"models": list(worker.models), "unfinished": worker.load.in_flight,
                               "latency": [], "speed": float(worker.labels["speed"]) if "speed" in worker.labels
                               else None, "role": worker.labels.get("role", "Hybrid"),
                               "state": worker.state(registry.clock()).value}
        return _json(out)

    r = app.router
    r.add_post("/workers", register)
    r.add_get("/workers", list_workers)
    r.add_get("/workers/{worker_id}", get_worker)
    r.add_post("/workers/{worker_id}/report", report)
    r.add_post("/workers/{worker_id}/drain", drain)
    r.add_delete("/workers/{worker_id}", remove)
    r.add_post("/nodes/add", nodes_add)
    r.add_post("/nodes/remove", nodes_remove)
    r.add_get("/nodes/status", nodes_status)


async def _json_body(request: web.Request) -> object:
    raw = await request.read()
    if not raw:
        return {}
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _is_worker_url(url: str) -> bool:
    """An absolute http(s) URL with a usable host and port: anything else fails every request later."""
    try:
        parsed = URL(url)
        host, port = parsed.host, parsed.port
    except ValueError:  # port out of range, broken IPv6 literal
        return False
    return parsed.scheme in ("http", "https") and bool(host) and " " not in (host or "") and port is not None


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _invalid(exc: ValidationError) -> web.Response:
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
    first = exc.errors()[0]["loc"] if exc.errors() else ()
    return error_response(400, f"Invalid body: {problems}", param=".".join(str(p) for p in first) or None)


def _unknown(worker_id: str) -> web.Response:
    return error_response(404, f"No worker `{worker_id}` is registered.", code="worker_not_found")
