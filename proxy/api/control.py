"""The control plane: worker registration, load reports, drain/remove, and LMDeploy's /nodes API.

Owns these routes and which credential each needs (and /fleet*: admin); what a credential is
lives in proxy/security/controlauth.py, what registering or draining means in the registry,
probing a URL-only worker in the monitor.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web
from pydantic import ValidationError
from yarl import URL

from proxy import identifiers as ids
from proxy import protocol
from proxy.config import ProxyConfig
from proxy.errors import error_response
from proxy.protocol import LoadReport, RegistrationAccepted, ReportAccepted, WorkerRegistration
from proxy.security import browser, peer
from proxy.security.browser import OwnNames
from proxy.security.controlauth import ADMIN_WHAT, Caller, ControlAuth, new_secret, secret_hash
from proxy.security.networks import (
    IPNetwork,
    WorkerUrlRefused,
    canonical_url,
    check_worker_url,
    is_worker_url,
    parse_networks,
)
from proxy.security.redact import redact_mapping, redact_text
from proxy.workers.monitor import PROBE_MODELS_DEADLINE_S, HealthMonitor
from proxy.workers.registry import Registry, Worker, worker_id_from_url

log = logging.getLogger("kvroute.control")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_GUARDED_PREFIXES = ("/workers", "/nodes", "/fleet")
_REGISTRY_KEY = web.AppKey("kvroute_control_registry", Registry)


@dataclass(frozen=True, slots=True)
class _Access:
    caller: Caller
    auth: ControlAuth
    config: ProxyConfig
    networks: tuple[IPNetwork, ...]


_ACCESS = web.RequestKey("kvroute_control_access", _Access)  # per request: the resolved caller, the config

_READ_ONLY = ("GET", "HEAD")


def _needs(request: web.Request) -> tuple[str, str | None]:
    """What a control route asks of its caller: ("admin"|"register"|"owner"|"read", worker id or None)."""
    path, method = request.path, request.method
    if method == "POST" and path in ("/workers", "/nodes/add"):
        return "register", None
    worker_id = request.match_info.get("worker_id")
    if method in _READ_ONLY and path in ("/workers", "/nodes/status"):
        return "read", None
    if path.startswith("/workers/") and worker_id is not None:
        return "owner", worker_id  # report, drain, delete, read: the worker itself or an admin
    if path == "/nodes/remove":
        return "owner", None  # the handler finds the worker by URL
    return "admin", None


def _refused_from_a_browser(request: web.Request, caller: Caller, names: OwnNames,
                            registry: Registry | None) -> web.Response | None:
    """403/415 for what a web page could send: another origin's request, a body that is not JSON on a
    state-changing route, or (without a credential) a Host that is not this proxy's (DNS rebinding)."""
    headers = request.headers
    why = browser.cross_origin(headers.get("Origin"), headers.get("Sec-Fetch-Site"), headers.get("Host"))
    if why is not None:
        log.warning("refused a cross-origin control request from %s (%s): %s %s", caller.host, why,
                    request.method, request.path)
        return error_response(403, f"The control plane does not answer web pages of other origins ({why}).",
                              "permission_error", code="cross_origin_refused")
    has_body = bool(request.content_length) or request.headers.get("Transfer-Encoding") is not None
    if (why := browser.refused_content_type(request.method, headers.get("Content-Type"), has_body)) is not None:
        return error_response(415, f"Control routes that change state take {browser.JSON_TYPE} only, not {why}.",
                              code="unsupported_media_type")
    if names.allows(headers.get("Host")) or _credentialed(caller, registry):
        return None
    log.warning("refused a control request from %s naming another host (Host: %s)", caller.host,
                redact_text((headers.get("Host") or "")[:80]))
    return error_response(403, "The Host header does not name this proxy; without a token the control plane "
                               "answers only requests for its own names (proxy.allowed_hosts adds more).",
                          "permission_error", code="host_not_allowed")


def _credentialed(caller: Caller, registry: Registry | None) -> bool:
    """A credential a page cannot have: the admin or worker token, or a registered worker's own secret."""
    if caller.admin and caller.has_credential or caller.worker_token:
        return True
    return caller.has_credential and registry is not None and bool(set(caller.digests) & set(_secret_hashes(registry)))


def auth_middleware(config: ProxyConfig) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Credentials for the control plane. Administering always takes the admin token; callers on this
    machine may read without one; workers act on themselves only, with the secret they got at
    registration. Nothing from a web page of another origin is answered."""
    auth = ControlAuth(config)
    networks = parse_networks(config.worker_networks)
    names = OwnNames(config.host, config.allowed_hosts)

    @web.middleware
    async def check_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith(_GUARDED_PREFIXES):
            return await handler(request)
        caller = auth.caller(request)
        if (refused := _refused_from_a_browser(request, caller, names, request.app.get(_REGISTRY_KEY))) is not None:
            return refused
        request[_ACCESS] = _Access(caller, auth, config, networks)
        if caller.admin:
            return await handler(request)
        need, worker_id = _needs(request)
        reading_here = caller.loopback and not caller.has_credential  # a presented credential is judged as such
        if need == "read" and reading_here:
            return await handler(request)
        if need == "register" and (caller.may_register or caller.has_credential):
            return await handler(request)  # an owner re-registering is checked against the body
        if need == "owner" and reading_here and request.method in _READ_ONLY:
            return await handler(request)
        if need == "owner" and caller.has_credential:
            registry = request.app.get(_REGISTRY_KEY)
            worker = registry.get(worker_id) if registry is not None and worker_id is not None else None
            if worker_id is None or (worker is not None and caller.owns(worker.secret_hash)):
                return await handler(request)
            # Unknown, or another worker's: one answer for both (401, or 403 for a credential valid elsewhere),
            # so that no credential tells which ids exist; a worker the proxy forgot registers again on 401.
        registry = request.app.get(_REGISTRY_KEY)
        hashes = _secret_hashes(registry) if registry is not None and caller.has_credential else []
        return auth.denied(caller, ADMIN_WHAT if need in ("admin", "read") else "this worker route", hashes)

    return check_token


def _secret_hashes(registry: Registry) -> list[str | None]:
    """Every worker's secret hash: a denied caller holding one of them gets 403 (valid, not enough), not 401."""
    return [w.secret_hash for w in registry.workers()]


def _access(request: web.Request) -> _Access:
    return request[_ACCESS]


def _may_replace(access: _Access, holders: list[Worker], now: float, worker_id: str, url: str) -> Worker | None:
    """The first live worker this caller may not displace, or None.

    A worker that went silent and comes back under the same id AND the same URL (a restart that lost
    its secret) takes its entry back at once: no traffic can move anywhere by that, so it need not
    wait out the takeover delay that guards against redirecting a worker's requests."""
    url = url.rstrip("/")
    for holder in holders:
        if access.caller.admin or access.caller.owns(holder.secret_hash) or holder.replaceable(now):
            continue
        if holder.worker_id == worker_id and holder.url == url and holder.silent(now):
            continue
        return holder
    return None


def _conflict(holder: Worker) -> web.Response:
    return error_response(409, f"Worker `{holder.worker_id}` at {holder.url} is registered and alive; it must "
                               "deregister first (or stay silent for a while) before another registration takes "
                               "its id or URL.", code="worker_conflict")


def _own_address(request: web.Request, config: ProxyConfig) -> tuple[set[int], set[str]]:
    ports, hosts = {config.port}, {config.host}
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    if isinstance(sockname, tuple) and len(sockname) >= 2:
        ports.add(int(sockname[1]))
        hosts.add(str(sockname[0]))
    return ports, hosts


async def _refuse_url(request: web.Request, url: str) -> web.Response | None:
    """403 for a worker URL outside proxy.worker_networks or at the proxy itself; nothing is sent to it."""
    access = _access(request)
    ports, hosts = _own_address(request, access.config)
    try:
        await check_worker_url(url, access.networks, ports, hosts)
    except WorkerUrlRefused as exc:
        log.warning("refused worker url from %s: %s", access.caller.host, exc)
        return error_response(403, f"Refused: {exc}.", "permission_error", param="url", code="url_not_allowed")
    return None


def add_routes(app: web.Application, registry: Registry, monitor: HealthMonitor,
               queue_lengths: Callable[[], dict[str, int]]) -> None:
    app[_REGISTRY_KEY] = registry
    peer.install(app)

    async def register(request: web.Request) -> web.Response:
        try:
            reg = WorkerRegistration.model_validate_json(await request.read())
        except ValidationError as exc:
            return _invalid(exc)
        if not is_worker_url(reg.url):
            return error_response(400, f"`url` must be http(s)://host[:port] without credentials, query or "
                                       f"fragment, got {redact_text(reg.url)!r}.", param="url", code="invalid_url")
        reg = reg.model_copy(update={"url": canonical_url(reg.url)})  # one spelling per address
        access = _access(request)
        worker_id = reg.worker_id or worker_id_from_url(reg.url)
        holders = registry.holders(worker_id, reg.url)
        if not access.caller.may_register and not any(access.caller.owns(h.secret_hash) for h in holders):
            return access.auth.denied(access.caller, "registering workers", _secret_hashes(registry))
        if (refused := await _refuse_url(request, reg.url)) is not None:
            return refused
        holders = registry.holders(worker_id, reg.url)  # again: the address check awaited
        if (holder := _may_replace(access, holders, registry.clock(), worker_id, reg.url)) is not None:
            return _conflict(holder)
        secret = new_secret()
        worker = registry.register(reg, secret_hash=secret_hash(secret))
        log.info("registered %s at %s serving %s", worker.worker_id, worker.url, ",".join(worker.models))
        return _json(RegistrationAccepted(worker_id=worker.worker_id, worker_secret=secret,
                                          report_interval_s=_report_interval()).model_dump())

    async def report(request: web.Request) -> web.Response:
        worker_id = request.match_info["worker_id"]
        try:
            load = LoadReport.model_validate_json(await request.read())
        except ValidationError as exc:
            return _invalid(exc)
        if load.worker_id != worker_id:
            return error_response(400, f"report for `{load.worker_id}` sent to /workers/{worker_id}/report",
                                  param="worker_id")
        if not registry.record_report(worker_id, load) or (worker := registry.get(worker_id)) is None:
            return _unknown(worker_id)
        answer = ReportAccepted(report_interval_s=_report_interval(), kv_resync=worker.kv_resync)
        return _json(answer.model_dump(exclude=None if worker.kv_resync else {"kv_resync"}))

    def _report_interval() -> float:
        return protocol.report_interval_for(len(registry))

    async def list_workers(request: web.Request) -> web.Response:
        now = registry.clock()
        return _json({"workers": [_public(w, now) for w in registry.workers()], "queues": queue_lengths()})

    async def get_worker(request: web.Request) -> web.Response:
        worker = registry.get(request.match_info["worker_id"])
        if worker is None:
            return _unknown(request.match_info["worker_id"])
        return _json(_public(worker, registry.clock()))

    async def drain(request: web.Request) -> web.Response:
        worker = registry.drain(request.match_info["worker_id"])
        if worker is None:
            return _unknown(request.match_info["worker_id"])
        log.info("draining %s", worker.worker_id)
        return _json(_public(worker, registry.clock()))

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
        if not isinstance(url, str) or len(url) > ids.MAX_URL_CHARS or not is_worker_url(url):
            return error_response(400, "`url` (http://host:port, no credentials, query or fragment) is required.",
                                  param="url")
        access = _access(request)
        if not access.caller.may_register:
            return access.auth.denied(access.caller, "registering workers")
        url = canonical_url(url)
        # LMDeploy bound to 0.0.0.0 announces http://0.0.0.0:PORT: dial the address it called us from.
        url, unspecified = _from_caller(url, access.caller.host)
        if unspecified:
            return error_response(400, f"`url` {url!r} names no host to dial (0.0.0.0) and the caller's address is "
                                       "unknown; pass the worker's reachable address (lmdeploy serve api_server "
                                       "--server-name HOST).", param="url", code="invalid_url")
        status = body.get("status") if isinstance(body.get("status"), dict) else {}
        listed = status.get("models")
        models = [m for m in listed if isinstance(m, str)] if isinstance(listed, list) else []
        labels = {"role": str(status.get("role", "Hybrid"))}
        if isinstance(status.get("speed"), int | float):
            labels["speed"] = str(status["speed"])
        try:
            for model in models[:ids.MAX_MODELS_PER_WORKER + 1]:
                ids.model_name(model)
            if len(models) > ids.MAX_MODELS_PER_WORKER:
                raise ids.UnsafeIdentifier(f"at most {ids.MAX_MODELS_PER_WORKER} models per worker")
            ids.labels(labels)
        except ids.UnsafeIdentifier as exc:
            return error_response(400, f"Invalid node status: {exc}.", param="status", code="invalid_identifier")
        if (refused := await _refuse_url(request, url)) is not None:
            return refused  # before any probe: no request reaches an address outside the allowlist
        worker_id = worker_id_from_url(url)
        # LMDeploy re-announcing the same URL (a restart) refreshes its entry; anything else live is kept.
        holders = [h for h in registry.holders(worker_id, url)
                   if not (h.source == "nodes" and h.url == url.rstrip("/") and h.worker_id == worker_id)]
        if (holder := _may_replace(access, holders, registry.clock(), worker_id, url)) is not None:
            return _conflict(holder)
        previous = registry.get(worker_id)
        was_drained = previous is not None and previous.drain_requested
        secret = new_secret()
        deadline = asyncio.get_running_loop().time() + PROBE_MODELS_DEADLINE_S
        try:
            worker = await asyncio.wait_for(monitor.add_by_url(url, models or None, source="nodes", labels=labels,
                                                               secret_hash=secret_hash(secret)),
                                            PROBE_MODELS_DEADLINE_S)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            # One answer, at one time, for a closed port, a silent one, a redirect or a non-OpenAI server:
            # neither its words nor its timing tell a port scanner which ports are open.
            await asyncio.sleep(max(0.0, deadline - asyncio.get_running_loop().time()))
            return error_response(400, "Could not list the models of that URL (GET /v1/models).", param="url",
                                  code="worker_unreachable")
        if was_drained:  # a re-announcement does not undo an operator's drain
            registry.drain(worker.worker_id)
        log.info("node %s added as %s serving %s", url, worker.worker_id, ",".join(worker.models))
        return _json({"worker_id": worker.worker_id, "models": list(worker.models), "worker_secret": secret,
                      "message": "Added successfully"})

    async def nodes_remove(request: web.Request) -> web.Response:
        url = request.query.get("node_url") or request.query.get("url")
        if url is None:
            body = await _json_body(request)
            url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str) or len(url) > ids.MAX_URL_CHARS:
            return error_response(400, "`url` is required.", param="url")
        if is_worker_url(url):
            url = canonical_url(url)
        target = next((w for w in registry.workers() if w.url == url.rstrip("/")), None)
        access = _access(request)
        if not access.caller.admin and (target is None or not access.caller.owns(target.secret_hash)):
            # unknown, or not this caller's: one answer (no oracle of which URLs are registered)
            return access.auth.denied(access.caller, "removing this node", _secret_hashes(registry))
        worker = registry.remove_url(url) if target is not None else None
        if worker is None:
            return error_response(404, f"No node with url {redact_text(ids.for_log(url))}.", code="worker_not_found")
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


def _public(worker: Worker, now: float) -> dict[str, object]:
    """A worker as /workers shows it: secret-looking labels and error texts masked."""
    out = worker.to_json(now)
    out["labels"] = redact_mapping(out.get("labels") or {})
    if isinstance(out.get("last_error"), str):
        out["last_error"] = redact_text(out["last_error"])
    return out


async def _json_body(request: web.Request) -> object:
    raw = await request.read()
    if not raw:
        return {}
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _from_caller(url: str, caller_host: str) -> tuple[str, bool]:
    """A URL whose host is 0.0.0.0/:: with the caller's address in its place; (url, True) when it cannot be."""
    parsed = URL(url)
    if (parsed.host or "") not in ("0.0.0.0", "::"):
        return url, False
    try:
        caller = ipaddress.ip_address(caller_host.split("%", 1)[0])
    except ValueError:
        return url, True
    if caller.is_unspecified:
        return url, True
    return str(parsed.with_host(str(caller))).rstrip("/"), False


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _invalid(exc: ValidationError) -> web.Response:
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg'].removeprefix('Value error, ')}"
                         for e in exc.errors())
    first = exc.errors()[0]["loc"] if exc.errors() else ()
    return error_response(400, f"Invalid body: {problems}", param=".".join(str(p) for p in first) or None)


def _unknown(worker_id: str) -> web.Response:
    return error_response(404, f"No worker `{ids.for_log(worker_id, 128)}` is registered.", code="worker_not_found")

